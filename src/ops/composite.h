// Registration of the composite fallbacks (ops built from other ops). See composite.cpp.
#pragma once

#include "backend/registry.h"

namespace lathe {

void register_composites(KernelRegistry& registry);

}  // namespace lathe
