# src/data: the Hugging Face byte-level BPE tokenizer (tokenizer.json), later chat templates,
# datasets and packing. Included from src/CMakeLists.txt after the `lathe` target exists.
# Needs PCRE2 (regex splitting, JIT) and ICU (NFC); both are Debian packages (libpcre2-dev, libicu-dev).
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(ICU REQUIRED IMPORTED_TARGET icu-uc)

target_sources(lathe PRIVATE
  data/bpe.cpp
  data/pretokenize.cpp
  data/tokenizer.cpp
  data/tokenizer_load.cpp
  data/tokenizer_files.cpp
)
target_link_libraries(lathe PUBLIC PkgConfig::PCRE2 PkgConfig::ICU)
