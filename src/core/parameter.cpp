#include "core/parameter.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lathe {

std::string shard_metadata(const ShardLayout& l) {
  return fmt::format("{{\"global_shape\": [{}], \"offset\": [{}], \"flat_begin\": {}, \"group\": \"{}\"}}",
                     fmt::join(l.global_shape, ", "), fmt::join(l.offset, ", "), l.flat_begin, l.group);
}

}  // namespace lathe
