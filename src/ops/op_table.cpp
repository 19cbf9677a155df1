#include "ops/op_table.h"

#include "core/error.h"

namespace lathe {

namespace {
struct OpInfo {
  std::string_view name;
  int num_inputs;
};
constexpr OpInfo kOpInfo[] = {
#define LATHE_X(name, n_in) {#name, n_in},
    LATHE_OP_LIST(LATHE_X)
#undef LATHE_X
};
}  // namespace

std::string_view op_name(OpId op) { return kOpInfo[int(op)].name; }
int op_num_inputs(OpId op) { return kOpInfo[int(op)].num_inputs; }

OpId op_from_name(std::string_view name) {
  for (int i = 0; i < kOpCount; ++i)
    if (kOpInfo[i].name == name) return OpId(i);
  LATHE_FAIL("ops: unknown op '{}'", name);
}

}  // namespace lathe
