lathe_add_test(test_io io/test_safetensors.cpp)
