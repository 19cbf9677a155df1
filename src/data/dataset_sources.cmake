# Datasets, packing and prepared corpora (docs/data.md). Included from src/CMakeLists.txt after
# data/sources.cmake and data/chat_sources.cmake (it uses the tokenizer and chat templates).
target_sources(lathe PRIVATE data/dataset.cpp data/packing.cpp data/token_file.cpp)
