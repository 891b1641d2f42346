// pocketllm_cpp._native.Model (a forward pass over sequence slices, with per-request state slots) and the Llama
// family's model, built from typed config and layer structs whose tensors are the checkpoint's bytes, read in place.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "pocketllm_cpp/llama_model.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One Llama layer as Python gives it.
struct PyLlamaLayer {
    std::optional<Tensor> q, k, v, o, gate, up, down;
    std::vector<float> input_norm, post_attention_norm, q_norm, k_norm;  // q_norm, k_norm: Qwen3 only
};

void check_size(const std::vector<float>& v, int64_t size, const std::string& what) {
    if (static_cast<int64_t>(v.size()) != size) {
        throw std::invalid_argument(what + " has " + std::to_string(v.size()) + " values, expected " +
                                    std::to_string(size));
    }
}

void check_shape(const WeightView& w, int64_t rows, int64_t cols, const std::string& what) {
    if (w.rows != rows || w.cols != cols) {
        throw std::invalid_argument(what + " is [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                                    "], the config needs [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
    }
}

LlamaLayer llama_layer(const LlamaConfig& c, const PyLlamaLayer& layer, TensorViews& get) {
    const int64_t hidden = c.hidden_size, q_rows = c.num_heads * c.head_dim, kv_rows = c.num_kv_heads * c.head_dim;
    LlamaLayer w{get.matrix(layer.q, "q_proj"), get.matrix(layer.k, "k_proj"), get.matrix(layer.v, "v_proj"),
                 get.matrix(layer.o, "o_proj"), get.matrix(layer.gate, "gate_proj"), get.matrix(layer.up, "up_proj"),
                 get.matrix(layer.down, "down_proj"), layer.input_norm, layer.post_attention_norm,
                 c.qk_norm ? layer.q_norm : std::vector<float>{}, c.qk_norm ? layer.k_norm : std::vector<float>{}};
    check_shape(w.q, q_rows, hidden, get.at + "q_proj");
    check_shape(w.k, kv_rows, hidden, get.at + "k_proj");
    check_shape(w.v, kv_rows, hidden, get.at + "v_proj");
    check_shape(w.o, hidden, q_rows, get.at + "o_proj");
    check_shape(w.gate, c.intermediate_size, hidden, get.at + "gate_proj");
    check_shape(w.up, c.intermediate_size, hidden, get.at + "up_proj");
    check_shape(w.down, hidden, c.intermediate_size, get.at + "down_proj");
    check_size(w.input_norm, hidden, get.at + "input_norm");
    check_size(w.post_attention_norm, hidden, get.at + "post_attention_norm");
    if (c.qk_norm) {
        check_size(w.q_norm, c.head_dim, get.at + "q_norm");
        check_size(w.k_norm, c.head_dim, get.at + "k_norm");
    }
    return w;
}

}  // namespace

void pocketllm::bind_model(nb::module_& m) {
    nb::enum_<Pooling>(m, "Pooling", "How a slice's final hidden states are pooled (embeddings).")
        .value("none", Pooling::None)
        .value("last", Pooling::Last)
        .value("mean", Pooling::Mean)
        .value("cls", Pooling::Cls);
    nb::class_<SequenceSlice>(m, "SequenceSlice", "One sequence's share of a forward pass.")
        .def(nb::init<int64_t, int64_t, std::vector<int32_t>, int64_t, Pooling, int32_t, int64_t>(), nb::arg("start"),
             nb::arg("num_tokens"), nb::arg("block_table"), nb::arg("num_logits") = 1, nb::kw_only(),
             nb::arg("pool") = Pooling::None, nb::arg("state_slot") = -1, nb::arg("prompt_end") = -1)
        .def_rw("start", &SequenceSlice::start, "position of its first new token")
        .def_rw("num_tokens", &SequenceSlice::num_tokens)
        .def_rw("block_table", &SequenceSlice::block_table, "its KV blocks")
        .def_rw("num_logits", &SequenceSlice::num_logits, "logits wanted of its last num_logits tokens")
        .def_rw("pool", &SequenceSlice::pool)
        .def_rw("state_slot", &SequenceSlice::state_slot, "its request's state slot (models with state layers)")
        .def_rw("prompt_end", &SequenceSlice::prompt_end,
                "its prompt's length (-1: the slice's end): state layers run later tokens one at a time");
    nb::class_<PyModel>(m, "Model", "A decoder over weights read in place, with its paged KV cache and state slots.")
        .def(
            "forward",
            [](PyModel& self, const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices) {
                std::vector<float> logits;
                {
                    nb::gil_scoped_release released;
                    logits = self.model->forward(tokens, slices);
                }
                const int64_t vocab = self.model->vocab_size();
                auto out = new_matrix(static_cast<int64_t>(logits.size()) / vocab, vocab);
                std::copy(logits.begin(), logits.end(), out.data());
                return out;
            },
            nb::arg("tokens"), nb::arg("slices"),
            "Run the new tokens of several sequences (in slice order in `tokens`); returns the logits of each slice's "
            "last num_logits tokens, in order.")
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
    nb::class_<LlamaConfig>(m, "LlamaConfig", "Sizes and options of a Llama-family model (Llama, Qwen3).")
        .def(nb::init<>())
        .def_rw("vocab_size", &LlamaConfig::vocab_size)
        .def_rw("hidden_size", &LlamaConfig::hidden_size)
        .def_rw("intermediate_size", &LlamaConfig::intermediate_size)
        .def_rw("num_layers", &LlamaConfig::num_layers)
        .def_rw("num_heads", &LlamaConfig::num_heads)
        .def_rw("num_kv_heads", &LlamaConfig::num_kv_heads)
        .def_rw("head_dim", &LlamaConfig::head_dim)
        .def_rw("rms_norm_eps", &LlamaConfig::rms_norm_eps)
        .def_rw("rope_pairs_adjacent", &LlamaConfig::rope_pairs_adjacent)
        .def_rw("qk_norm", &LlamaConfig::qk_norm)
        .def_rw("exact_activations", &LlamaConfig::exact_activations)
        .def_rw("inv_freq", &LlamaConfig::inv_freq)
        .def_rw("rope_attention_factor", &LlamaConfig::rope_attention_factor)
        .def_prop_rw(
            "kv_cache_dtype", [](const LlamaConfig& c) { return kv_type_name(c.kv_type); },
            [](LlamaConfig& c, const std::string& name) { c.kv_type = parse_kv_type(name); });
    nb::class_<PyLlamaLayer>(m, "LlamaLayer", "One Llama layer's tensors and norms.")
        .def(nb::init<>())
        .def_rw("q", &PyLlamaLayer::q, nb::arg().none())
        .def_rw("k", &PyLlamaLayer::k, nb::arg().none())
        .def_rw("v", &PyLlamaLayer::v, nb::arg().none())
        .def_rw("o", &PyLlamaLayer::o, nb::arg().none())
        .def_rw("gate", &PyLlamaLayer::gate, nb::arg().none())
        .def_rw("up", &PyLlamaLayer::up, nb::arg().none())
        .def_rw("down", &PyLlamaLayer::down, nb::arg().none())
        .def_rw("input_norm", &PyLlamaLayer::input_norm)
        .def_rw("post_attention_norm", &PyLlamaLayer::post_attention_norm)
        .def_rw("q_norm", &PyLlamaLayer::q_norm)
        .def_rw("k_norm", &PyLlamaLayer::k_norm);
    m.def(
        "llama_model",
        [](const LlamaConfig& config, const Tensor& embedding, const std::vector<PyLlamaLayer>& layers,
           const std::vector<float>& final_norm, const Tensor& lm_head, int64_t num_blocks, int64_t block_size,
           int num_threads) {
            if (static_cast<int64_t>(layers.size()) != config.num_layers) {
                throw std::invalid_argument(std::to_string(layers.size()) + " layers, the config says " +
                                            std::to_string(config.num_layers));
            }
            PyModel model;
            std::vector<LlamaLayer> built;
            for (const PyLlamaLayer& layer : layers) {
                TensorViews get{model, "layer " + std::to_string(built.size()) + " "};
                built.push_back(llama_layer(config, layer, get));
            }
            TensorViews get{model, ""};
            const WeightView embed = get.matrix(embedding, "embedding"), head = get.matrix(lm_head, "lm_head");
            check_shape(embed, config.vocab_size, config.hidden_size, "embedding");
            check_shape(head, config.vocab_size, config.hidden_size, "lm_head");
            check_size(final_norm, config.hidden_size, "final_norm");
            model.model = std::make_shared<LlamaModel>(config, embed, std::move(built), final_norm, head, num_blocks,
                                                       block_size, num_threads);
            return model;
        },
        nb::arg("config"), nb::arg("embedding"), nb::arg("layers"), nb::arg("final_norm"), nb::arg("lm_head"),
        nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("num_threads"),
        "A Llama-family Model over the tensors' bytes, read in place.");
}
