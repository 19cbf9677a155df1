#include "cli_support.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "backend/runtime.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/files.h"
#include "data/tokenizer_files.h"
#include "io/safetensors.h"

namespace lathe::cli {

namespace fs = std::filesystem;

namespace {

// The floating dtype that holds most elements of these tensors (mixed folders keep a few tensors, e.g. norms, wider).
DType majority_dtype(const std::vector<const io::SafetensorsTensor*>& tensors, const std::string& where) {
  std::map<DType, int64_t> elements;
  for (const io::SafetensorsTensor* t : tensors)
    if (is_floating(t->dtype)) elements[t->dtype] += t->numel;
  LATHE_CHECK(!elements.empty(), "{} holds no floating-point tensors, so it has no weight dtype; pass --dtype", where);
  DType best = elements.begin()->first;
  for (const auto& [dtype, n] : elements)
    if (n > elements[best]) best = dtype;
  return best == DType::F64 ? DType::F32 : best;
}

}  // namespace

CLI::Validator number_in(double min, double max) {
  const std::string range = max == std::numeric_limits<double>::infinity() ? fmt::format(">= {}", min)
                                                                            : fmt::format("in [{}, {}]", min, max);
  return CLI::Validator(
      [min, max, range](std::string& value) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(value, v)) return fmt::format("'{}' is not a number", value);
        if (!(v >= min && v <= max)) return fmt::format("must be {}, not {}", range, value);
        return {};
      },
      range);
}

CLI::Validator in_unit_interval() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(value, v) || !(v > 0 && v <= 1))
          return fmt::format("must be in (0, 1], not {}", value);
        return {};
      },
      "in (0, 1]");
}

DType model_folder_dtype(const std::string& dir) {
  const fs::path config = fs::path(dir) / "config.json";
  if (fs::exists(config)) {
    const nlohmann::json j = nlohmann::json::parse(read_text_file(config.string(), "model"), nullptr, false);
    LATHE_CHECK(!j.is_discarded() && j.is_object(), "model: {} is not a JSON object", config.string());
    for (const char* key : {"dtype", "torch_dtype"}) {
      if (!j.contains(key) || !j[key].is_string()) continue;
      const std::string name = j[key].get<std::string>();
      if (name == "float32" || name == "float64") return DType::F32;
      if (name == "bfloat16") return DType::BF16;
      if (name == "float16") return DType::F16;
    }  // absent, "auto" or unknown: the tensors say
  }
  const io::SafetensorsModel model = io::SafetensorsModel::open(dir);
  std::vector<const io::SafetensorsTensor*> tensors;
  for (const io::SafetensorsFile& f : model.files())
    for (const io::SafetensorsTensor& t : f.tensors()) tensors.push_back(&t);
  return majority_dtype(tensors, "model: " + dir);
}

DType adapter_folder_dtype(const std::string& dir) {
  const io::SafetensorsFile file = io::SafetensorsFile::open((fs::path(dir) / "adapter_model.safetensors").string());
  std::vector<const io::SafetensorsTensor*> tensors;
  for (const io::SafetensorsTensor& t : file.tensors()) tensors.push_back(&t);
  return majority_dtype(tensors, "lora: " + file.path());
}

ChatTemplateKwargs resolve_chat_template_kwargs(bool given, const std::string& option_text,
                                                const std::vector<std::string>& dirs, const std::string& who) {
  ChatTemplateKwargs r;
  if (given) {
    r.kwargs = data::parse_chat_template_kwargs(option_text, who + ": --chat-template-kwargs");
    r.source = "--chat-template-kwargs";
  } else {
    r.source = "default: no chat_template_kwargs.json in the model folders";
    for (const std::string& dir : dirs) {
      if (dir.empty()) continue;
      if (std::optional<nlohmann::ordered_json> found = data::read_chat_template_kwargs(dir)) {
        r.kwargs = std::move(*found);
        r.source = (fs::path(dir) / data::kChatTemplateKwargsFile).string();
        break;
      }
    }
  }
  fmt::print(stderr, "{}: chat template kwargs {} (from {})\n", who, r.kwargs.dump(), r.source);
  return r;
}

void for_each_jsonl_row(const std::string& path, const std::string& who,
                        const std::function<void(const nlohmann::ordered_json& row, int64_t line)>& row) {
  const std::string text = read_text_file(path, who);
  size_t begin = 0;
  for (int64_t n = 1; begin < text.size(); ++n) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines carry no request
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      LATHE_FAIL("{}: {}:{}: invalid JSON: {}", who, path, n, e.what());
    }
    try {
      row(j, n);
    } catch (const Error& e) {
      std::string_view what = e.what();
      if (what.starts_with(who + ": ")) what.remove_prefix(who.size() + 2);  // said once, before file:line
      LATHE_FAIL("{}: {}:{}: {}", who, path, n, what);
    }
  }
}

std::vector<std::vector<std::string>> gather_lines(Runtime& rt, Communicator& world, Device device,
                                                   const std::vector<std::string>& mine) {
  std::string bytes;
  std::vector<int64_t> lengths;
  for (const std::string& l : mine) bytes += l, lengths.push_back(int64_t(l.size()));
  const int n = world.size(), me = world.rank();
  // First every rank's line count and byte count, then the bytes, all to rank 0.
  std::vector<int64_t> sizes_all(size_t(2 * n), 0);
  std::vector<int64_t> my_sizes = {int64_t(mine.size()), int64_t(bytes.size())};
  Tensor mine_t = rt.from_host(my_sizes.data(), {2}, DType::I64, device);
  Tensor all_t = rt.from_host(sizes_all.data(), {2 * int64_t(n)}, DType::I64, device);
  world.all_gather(mine_t, all_t).wait();
  const Tensor all_h = rt.copy_to(all_t, Device::cpu());
  const int64_t* sz = all_h.data<int64_t>();
  auto send = [&](const std::vector<char>& payload, auto count_of) {
    std::vector<int64_t> sc(size_t(n), 0), rc(size_t(n), 0);
    sc[0] = int64_t(payload.size());
    int64_t total = 0;
    if (me == 0)
      for (int r = 0; r < n; ++r) rc[size_t(r)] = count_of(r), total += rc[size_t(r)];
    std::vector<char> host_in = payload.empty() ? std::vector<char>(1) : payload;
    Tensor in = rt.from_host(host_in.data(), {int64_t(payload.size())}, DType::U8, device);
    std::vector<char> zeros(size_t(std::max<int64_t>(total, 1)));
    Tensor out = rt.from_host(zeros.data(), {total}, DType::U8, device);
    world.all_to_all(in, sc, out, rc).wait();
    const Tensor h = rt.copy_to(out, Device::cpu());
    return std::vector<char>(static_cast<const char*>(h.data_ptr()), static_cast<const char*>(h.data_ptr()) + total);
  };
  std::vector<char> len_bytes(lengths.size() * sizeof(int64_t));
  std::memcpy(len_bytes.data(), lengths.data(), len_bytes.size());
  const std::vector<char> all_lengths = send(len_bytes, [&](int r) { return sz[2 * r] * int64_t(sizeof(int64_t)); });
  const std::vector<char> all_bytes = send(std::vector<char>(bytes.begin(), bytes.end()), [&](int r) { return sz[2 * r + 1]; });
  std::vector<std::vector<std::string>> out(size_t(me == 0 ? n : 0));
  size_t li = 0, bi = 0;
  for (int r = 0; me == 0 && r < n; ++r)
    for (int64_t k = 0; k < sz[2 * r]; ++k, ++li) {
      int64_t len = 0;
      std::memcpy(&len, all_lengths.data() + li * sizeof(int64_t), sizeof(int64_t));
      out[size_t(r)].emplace_back(all_bytes.data() + bi, size_t(len));
      bi += size_t(len);
    }
  return out;
}

}  // namespace lathe::cli
