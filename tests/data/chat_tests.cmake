# Chat-template tests: interpreter unit tests and parity with @huggingface/jinja and transformers
# on tests/data/chat_fixtures/. Included from tests/CMakeLists.txt.
lathe_add_test(test_chat_template data/test_chat_template.cpp)
