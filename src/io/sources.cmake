target_sources(lathe PRIVATE io/safetensors.cpp)
