// The Python module pocketllm_cpp._native: thin wrappers that check every argument, then release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>

#include "bindings.h"
#include "pocketllm_cpp/isa.h"
#include "pocketllm_cpp/matmul.h"
#include "pocketllm_cpp/engine.h"
#include "pocketllm_cpp/llama_model.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

WeightView weight_view(const Bytes& data, const std::string& storage_type, int64_t rows, int64_t cols) {
    WeightView w{data.data(), parse_storage_type(storage_type), rows, cols};
    validate(w, static_cast<int64_t>(data.size()));
    return w;
}

using Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mask = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Matmul = std::tuple<Bytes, std::string, int64_t, int64_t>;  // raw bytes, storage type, rows, cols

WeightView view(PyModel& model, const Matmul& m) {
    const auto& [data, storage_type, rows, cols] = m;
    model.owners.push_back(nb::cast(data));
    return weight_view(data, storage_type, rows, cols);
}

// What a value from Python must be, for the errors of field().
template <class T> constexpr const char* kKind = "of another type";
template <> constexpr const char* kKind<int64_t> = "a 64-bit integer";
template <> constexpr const char* kKind<int> = "a 32-bit integer";
template <> constexpr const char* kKind<float> = "a number";
template <> constexpr const char* kKind<bool> = "true or false";
template <> constexpr const char* kKind<std::string> = "a string";
template <> constexpr const char* kKind<std::vector<float>> = "a list of numbers";
template <> constexpr const char* kKind<std::vector<int32_t>> = "a list of 32-bit token ids";
template <> constexpr const char* kKind<std::vector<std::pair<int32_t, float>>> = "a list of (32-bit token id, number)";
template <> constexpr const char* kKind<Matmul> = "(uint8 bytes, storage type, rows, cols)";
template <> constexpr const char* kKind<Vector> = "a 1-D float32 array";

// d[key] as T. A missing key, or a value that does not convert (a token id past 32 bits, a string for a number),
// is a ValueError naming `what` and the key, never nanobind's bare std::bad_cast: a malformed checkpoint's
// metadata (an EOS id of 2^32 - 1) must fail as what it is, not as an internal error on every request.
template <class T>
T field(const nb::dict& d, const char* key, const std::string& what) {
    if (!d.contains(key)) throw std::invalid_argument(what + " has no '" + key + "'");
    const nb::object value = d[key];
    T out{};
    if (!nb::try_cast<T>(value, out)) {
        std::string shown = nb::repr(value).c_str();
        if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
        throw std::invalid_argument(what + " '" + key + "' must be " + kKind<T> + ", got " + shown);
    }
    return out;
}

std::vector<float> to_vector(const Vector& v, int64_t size, const char* what) {
    if (static_cast<int64_t>(v.size()) != size) {
        throw std::invalid_argument(std::string(what) + " has " + std::to_string(v.size()) + " values, expected " +
                                    std::to_string(size));
    }
    return std::vector<float>(v.data(), v.data() + v.size());
}

// An engine and the model it runs (whose Python object keeps the weights' arrays alive).
struct PyEngine {
    nb::object model_owner;
    std::unique_ptr<Engine> engine;
};

SamplingConfig sampling_config(const nb::dict& d) {
    const std::string what = "sampling";
    SamplingConfig c;
    c.max_tokens = field<int64_t>(d, "max_tokens", what);
    c.min_tokens = field<int64_t>(d, "min_tokens", what);
    c.temperature = field<float>(d, "temperature", what);
    c.top_p = field<float>(d, "top_p", what);
    c.top_k = field<int64_t>(d, "top_k", what);
    c.min_p = field<float>(d, "min_p", what);
    c.presence_penalty = field<float>(d, "presence_penalty", what);
    c.frequency_penalty = field<float>(d, "frequency_penalty", what);
    c.repetition_penalty = field<float>(d, "repetition_penalty", what);
    c.has_seed = d.contains("seed") && !d["seed"].is_none();
    if (c.has_seed) c.seed = static_cast<uint64_t>(field<int64_t>(d, "seed", what));  // two's complement of negatives
    c.stop_ids = field<std::vector<int32_t>>(d, "stop_ids", what);
    c.request_stop_ids = field<std::vector<int32_t>>(d, "request_stop_ids", what);
    c.logit_bias = field<std::vector<std::pair<int32_t, float>>>(d, "logit_bias", what);
    c.logprobs = field<int>(d, "logprobs", what);
    return c;
}

KvType parse_kv_type(const std::string& name) {
    if (name == "float16") return KvType::F16;
    if (name == "float32") return KvType::F32;
    throw std::invalid_argument("kv_cache_dtype must be float16 or float32, got '" + name + "'");
}

}  // namespace

ThreadPool& pocketllm::default_pool() {
    static ThreadPool pool(available_cpus());
    return pool;
}

nb::ndarray<nb::numpy, float, nb::ndim<2>> pocketllm::new_matrix(int64_t rows, int64_t cols) {
    auto* values = new float[static_cast<size_t>(rows * cols)];
    nb::capsule owner(values, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(values, {static_cast<size_t>(rows), static_cast<size_t>(cols)},
                                                     owner);
}

NB_MODULE(_native, m) {
    m.doc() = "PocketLLM's native CPU kernels (see pocketllm_cpp.kernels).";
    m.def("isa", [] { return isa_name(current_isa()); }, "The instruction set the kernels use now.");
    m.def("best_isa", [] { return isa_name(best_isa()); }, "The best instruction set of this CPU and build.");
    m.def("set_isa", &set_isa, nb::arg("name"), "Use 'scalar', 'avx2', 'avx512', 'neon' or 'auto'; ValueError if unavailable.");
    m.def("available_isas", [] { return available_isas(); }, "Every ISA this CPU and build can run, scalar first.");
    m.def("num_threads", [] { return default_pool().size(); }, "Threads of the kernels' pool.");
    m.def("available_cpus", &available_cpus,
          "The CPUs this process may use: its affinity mask, capped by its cgroup CPU quota (rounded up); at least 1.");
    m.def("cgroup_cpu_quota", &cgroup_cpu_quota, nb::arg("root") = "",
          "The cgroup CPU quota in CPUs (v2 cpu.max, v1 cfs quota over period, the smallest up the hierarchy), 0 for "
          "none; `root` prefixes the /proc and cgroup paths read (tests).");
    m.def(
        "matmul",
        [](const Bytes& weight, const std::string& storage_type, int64_t rows, int64_t cols, const Matrix& x,
           bool exact) {
            const WeightView w = weight_view(weight, storage_type, rows, cols);
            if (static_cast<int64_t>(x.shape(1)) != cols) {
                throw std::invalid_argument("x has " + std::to_string(x.shape(1)) + " columns; the weight takes " +
                                            std::to_string(cols));
            }
            const int64_t n = static_cast<int64_t>(x.shape(0));
            auto y = new_matrix(n, rows);
            {
                nb::gil_scoped_release released;
                matmul(w, x.data(), n, y.data(), default_pool(), exact);
            }
            return y;
        },
        nb::arg("weight"), nb::arg("storage_type"), nb::arg("rows"), nb::arg("cols"), nb::arg("x"),
        nb::arg("exact") = false,
        "y = x @ W.T, W given as its raw bytes in `storage_type` with shape [rows, cols]; `exact`: float32 "
        "activations against blocks too.");
    m.def(
        "dequantize",
        [](const Bytes& weight, const std::string& storage_type, int64_t rows, int64_t cols) {
            const WeightView w = weight_view(weight, storage_type, rows, cols);
            auto out = new_matrix(rows, cols);
            {
                nb::gil_scoped_release released;
                dequantize(w, out.data());
            }
            return out;
        },
        nb::arg("weight"), nb::arg("storage_type"), nb::arg("rows"), nb::arg("cols"), "W as float32 [rows, cols].");
    nb::class_<PyModel>(m, "Model", "A Llama-family decoder over weights read in place, with its own paged KV cache.")
        .def(
            "__init__",
            [](PyModel* self, const nb::dict& config, const Matmul& embedding, const std::vector<nb::dict>& layers,
               const Vector& final_norm, const Matmul& lm_head, int64_t num_blocks, int64_t block_size,
               int num_threads) {
                new (self) PyModel();
                const std::string what = "model config";
                auto get = [&](const char* key) { return field<int64_t>(config, key, what); };
                auto flag = [&](const char* key) { return field<bool>(config, key, what); };
                LlamaConfig c{get("vocab_size"), get("hidden_size"), get("intermediate_size"), get("num_layers"),
                              get("num_heads"), get("num_kv_heads"), get("head_dim"),
                              field<float>(config, "rms_norm_eps", what), flag("rope_pairs_adjacent"),
                              flag("qk_norm"), flag("exact_activations"),
                              field<std::vector<float>>(config, "inv_freq", what),
                              field<float>(config, "rope_attention_factor", what),
                              parse_kv_type(field<std::string>(config, "kv_cache_dtype", what))};
                std::vector<LlamaLayer> weights;
                for (const nb::dict& layer : layers) {
                    const std::string where = "layer " + std::to_string(weights.size());
                    auto mat = [&](const char* key) { return view(*self, field<Matmul>(layer, key, where)); };
                    auto norm = [&](const char* key, int64_t size) {
                        return to_vector(field<Vector>(layer, key, where), size, key);
                    };
                    LlamaLayer w{mat("q"), mat("k"), mat("v"), mat("o"), mat("gate"), mat("up"), mat("down"),
                                   norm("input_norm", c.hidden_size), norm("post_attention_norm", c.hidden_size),
                                   c.qk_norm ? norm("q_norm", c.head_dim) : std::vector<float>{},
                                   c.qk_norm ? norm("k_norm", c.head_dim) : std::vector<float>{}};
                    const std::pair<const WeightView*, std::pair<int64_t, int64_t>> shapes[] = {
                        {&w.q, {c.num_heads * c.head_dim, c.hidden_size}},
                        {&w.k, {c.num_kv_heads * c.head_dim, c.hidden_size}},
                        {&w.v, {c.num_kv_heads * c.head_dim, c.hidden_size}},
                        {&w.o, {c.hidden_size, c.num_heads * c.head_dim}},
                        {&w.gate, {c.intermediate_size, c.hidden_size}},
                        {&w.up, {c.intermediate_size, c.hidden_size}},
                        {&w.down, {c.hidden_size, c.intermediate_size}}};
                    for (const auto& [view, shape] : shapes) {
                        if (view->rows != shape.first || view->cols != shape.second) {
                            throw std::invalid_argument("a layer matrix has the wrong shape for the config");
                        }
                    }
                    weights.push_back(std::move(w));
                }
                const WeightView embed = view(*self, embedding), head = view(*self, lm_head);
                if (embed.rows != c.vocab_size || embed.cols != c.hidden_size || head.rows != c.vocab_size ||
                    head.cols != c.hidden_size) {
                    throw std::invalid_argument("embedding and lm_head must be [vocab_size, hidden_size]");
                }
                self->model = std::make_shared<LlamaModel>(c, embed, std::move(weights),
                                                      to_vector(final_norm, c.hidden_size, "final_norm"), head,
                                                      num_blocks, block_size, num_threads);
            },
            nb::arg("config"), nb::arg("embedding"), nb::arg("layers"), nb::arg("final_norm"), nb::arg("lm_head"),
            nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("num_threads"))
        .def(
            "forward",
            [](PyModel& self, const std::vector<int32_t>& tokens,
               const std::vector<std::tuple<int64_t, int64_t, std::vector<int32_t>, int64_t>>& slices,
               const std::vector<int32_t>& state_slots) {
                if (!state_slots.empty() && state_slots.size() != slices.size()) {
                    throw std::invalid_argument("state_slots must give one slot per slice");
                }
                std::vector<SequenceSlice> parts;
                for (const auto& [start, count, table, logits] : slices) parts.push_back({start, count, table, logits});
                for (size_t s = 0; s < state_slots.size(); ++s) parts[s].state_slot = state_slots[s];
                std::vector<float> logits;
                {
                    nb::gil_scoped_release released;
                    logits = self.model->forward(tokens, parts);
                }
                const int64_t vocab = self.model->vocab_size();
                auto out = new_matrix(static_cast<int64_t>(logits.size()) / vocab, vocab);
                std::copy(logits.begin(), logits.end(), out.data());
                return out;
            },
            nb::arg("tokens"), nb::arg("slices"), nb::arg("state_slots") = std::vector<int32_t>{},
            "Run tokens of several sequences: slices are (start, num_tokens, block_table, num_logits), each in "
            "its state slot (models with num_state_slots > 0); returns the logits of each slice's last num_logits "
            "tokens.")
        .def_prop_ro("num_state_slots", [](const PyModel& self) { return self.model->num_state_slots(); })
        .def_prop_ro("state_bytes", [](const PyModel& self) { return self.model->state_bytes(); })
        .def(
            "save_state",
            [](const PyModel& self, int32_t slot) {
                const int64_t floats = self.model->state_bytes() / 4;
                auto out = new_matrix(1, floats);
                self.model->save_state(slot, out.data());
                return out;
            },
            nb::arg("slot"), "A state slot's contents as float32 [1, state_bytes / 4].")
        .def(
            "load_state",
            [](PyModel& self, int32_t slot, const Vector& state) {
                if (static_cast<int64_t>(state.size()) * 4 != self.model->state_bytes()) {
                    throw std::invalid_argument("a state of " + std::to_string(state.size()) + " floats, expected " +
                                                std::to_string(self.model->state_bytes() / 4));
                }
                self.model->load_state(slot, state.data());
            },
            nb::arg("slot"), nb::arg("state"), "Restore a slot from save_state's floats (flattened).");
    nb::class_<EngineStats>(m, "EngineStats", "The engine's counters now (stats()).")
        .def_ro("running", &EngineStats::running)
        .def_ro("waiting", &EngineStats::waiting)
        .def_ro("blocks_total", &EngineStats::blocks_total)
        .def_ro("blocks_used", &EngineStats::blocks_used)
        .def_ro("preemptions", &EngineStats::preemptions)
        .def_ro("prefix_queries", &EngineStats::prefix_queries, "prompt tokens looked up in the prefix cache")
        .def_ro("prefix_hits", &EngineStats::prefix_hits, "of them, tokens found")
        .def_ro("state_snapshots", &EngineStats::state_snapshots, "state snapshots held (hybrid models)")
        .def_ro("state_snapshot_hits", &EngineStats::state_snapshot_hits, "requests resumed from one")
        .def_ro("state_snapshot_evictions", &EngineStats::state_snapshot_evictions);
    nb::class_<PyEngine>(m, "Engine", "Scheduler, KV block pool and sampler over a Model; one thread calls it.")
        .def(
            "__init__",
            [](PyEngine* self, nb::object model, int64_t max_num_seqs, int64_t max_num_batched_tokens,
               int64_t prefill_chunk_size, int64_t seed, bool prefix_caching, int64_t snapshot_bytes) {
                if (!nb::isinstance<PyModel>(model)) throw nb::type_error("model must be a pocketllm_cpp._native.Model");
                PyModel& owner = nb::cast<PyModel&>(model);
                new (self) PyEngine{model, std::make_unique<Engine>(
                    owner.model, SchedulerConfig{max_num_seqs, max_num_batched_tokens, prefill_chunk_size,
                                                 static_cast<uint64_t>(seed), prefix_caching, snapshot_bytes})};
            },
            nb::arg("model"), nb::arg("max_num_seqs"), nb::arg("max_num_batched_tokens"),
            nb::arg("prefill_chunk_size"), nb::arg("seed"), nb::arg("prefix_caching") = false, nb::arg("snapshot_bytes") = 0)
        .def(
            "add_request",
            [](PyEngine& self, const std::string& id, std::vector<int32_t> prompt, const nb::dict& sampling) {
                self.engine->add_request(id, std::move(prompt), sampling_config(sampling));
            },
            nb::arg("request_id"), nb::arg("prompt"), nb::arg("sampling"))
        .def(
            "add_embedding_request",
            [](PyEngine& self, const std::string& id, std::vector<int32_t> prompt, const std::string& pooling,
               bool normalize) {
                Pooling pool;
                if (pooling == "last") pool = Pooling::Last;
                else if (pooling == "mean") pool = Pooling::Mean;
                else if (pooling == "cls") pool = Pooling::Cls;
                else throw std::invalid_argument("pooling must be last, mean or cls, got '" + pooling + "'");
                self.engine->add_embedding_request(id, std::move(prompt), pool, normalize);
            },
            nb::arg("request_id"), nb::arg("prompt"), nb::arg("pooling"), nb::arg("normalize"))
        .def("step",
             [](PyEngine& self) {
                 std::vector<Delta> deltas;
                 {
                     nb::gil_scoped_release released;
                     deltas = self.engine->step();
                 }
                 nb::list out;
                 for (const Delta& d : deltas) {
                     nb::object lp = nb::none();
                     if (d.has_logprobs) {
                         lp = nb::make_tuple(d.logprobs.token, d.logprobs.logprob, d.logprobs.rank, d.logprobs.top);
                     }
                     nb::object embedding = nb::none();
                     if (!d.embedding.empty()) embedding = nb::cast(d.embedding);
                     out.append(nb::make_tuple(d.request_id, d.token, static_cast<int>(d.finish), d.stop_token_id, lp,
                                               embedding));
                 }
                 return out;
             },
             "One scheduling step: (request_id, token, finish 0/1 stop/2 length/3 nothing allowed, stop_token_id or "
             "-1, logprobs, embedding or None).")
        .def(
            "set_allowed",
            [](PyEngine& self, const std::string& id, const Mask& words) {
                self.engine->set_allowed(id, std::vector<uint32_t>(words.data(), words.data() + words.size()));
            },
            nb::arg("request_id"), nb::arg("words"),
            "The tokens a request may sample next: a bitmask of (vocab + 31) // 32 uint32 words (empty: any).")
        .def("abort", [](PyEngine& self, const std::vector<std::string>& ids) { self.engine->abort(ids); })
        .def("has_unfinished", [](PyEngine& self) { return self.engine->has_unfinished(); })
        .def("profile",
             [](PyEngine& self) {
                 const Profile p = self.engine->profile();
                 nb::dict d;
                 d["step"] = p.step, d["schedule"] = p.schedule, d["forward"] = p.forward, d["matmul"] = p.matmul;
                 d["lm_head"] = p.lm_head, d["attention"] = p.attention, d["wait"] = p.wait, d["sample"] = p.sample;
                 d["steps"] = p.steps, d["tokens"] = p.tokens, d["regions"] = p.regions;
                 return d;
             },
             "Seconds spent per phase since the last reset_profile(), with steps, tokens and parallel regions.")
        .def("reset_profile", [](PyEngine& self) { self.engine->reset_profile(); })
        .def("stats", [](PyEngine& self) { return self.engine->stats(); });
    m.def(
        "quantize_activations",
        [](const Matrix& x) {
            const int64_t n = static_cast<int64_t>(x.shape(0)), cols = static_cast<int64_t>(x.shape(1));
            if (cols % kBlock != 0) throw std::invalid_argument("columns must be a multiple of 32");
            QuantizedRows act;
            {
                nb::gil_scoped_release released;
                quantize_activations(x.data(), n, cols, act);
            }
            // As (scale, sum-term, codes) arrays, for tests against a numpy reference.
            auto scales = new_matrix(n, cols / kBlock), sums = new_matrix(n, cols / kBlock);
            std::copy(act.d.begin(), act.d.end(), scales.data());
            std::copy(act.s.begin(), act.s.end(), sums.data());
            auto* codes = new int8_t[act.qs.size()];
            std::copy(act.qs.begin(), act.qs.end(), codes);
            nb::capsule owner(codes, [](void* p) noexcept { delete[] static_cast<int8_t*>(p); });
            auto code_array = nb::ndarray<nb::numpy, int8_t, nb::ndim<2>>(
                codes, {static_cast<size_t>(n), static_cast<size_t>(cols)}, owner);
            return nb::make_tuple(scales, sums, code_array);
        },
        nb::arg("x"), "The 8-bit blocks activations are quantized to: (scales, scale * code sums, codes).");
    bind_moe(m);
    bind_qwen3_5(m);
}
