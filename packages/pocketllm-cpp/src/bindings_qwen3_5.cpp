// pocketllm_cpp._native.qwen3_5_model: a Qwen3.5 model (dense or MoE) from typed config and layer structs whose
// tensors are the checkpoint's bytes, read in place.
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
#include "moe.h"
#include "pocketllm_cpp/qwen3_5_model.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

// One layer as Python gives it: the tensors of its mixer kind and of its feed-forward kind, the rest left unset.
struct PyQwen3_5Layer {
    std::string kind;  // "full_attention" or "linear_attention"
    std::vector<float> input_norm, post_attention_norm, q_norm, k_norm, conv, decay, dt_bias, norm;
    std::optional<Tensor> q, k, v, o, qkv, z, b, a, out, gate, up, down;
    // MoE: the router; the experts' gate, up and down, each one stacked [experts, out, in] tensor or a matrix per
    // expert (or gate and up fused, transformers' [experts, 2 * ff, hidden]); the shared expert.
    std::optional<Tensor> router, experts_gate_up;
    std::vector<Tensor> experts_gate, experts_up, experts_down;
    std::optional<Tensor> shared_gate, shared_up, shared_down, shared_expert_gate;
    int64_t top_k = 0;
    bool norm_topk_prob = true;
};

std::shared_ptr<const MoeWeights> moe_weights(const PyQwen3_5Layer& layer, TensorViews& get) {
    auto w = std::make_shared<MoeWeights>();
    w->router = get.matrix(layer.router, "router");
    if (layer.experts_gate_up) {  // transformers' fused layout: each expert's gate rows, then its up rows
        for (const WeightView& both : get.stacked(layer.experts_gate_up, "experts gate_up")) {
            if (both.rows % 2 != 0) throw std::invalid_argument(get.at + "experts gate_up has an odd row count");
            const int64_t half = both.rows / 2, bytes = half * static_cast<int64_t>(row_bytes(both.type, both.cols));
            w->gate.push_back({both.data, both.type, half, both.cols});
            w->up.push_back({both.data + bytes, both.type, half, both.cols});
        }
    } else {
        w->gate = get.experts(layer.experts_gate, "experts gate");
        w->up = get.experts(layer.experts_up, "experts up");
    }
    w->down = get.experts(layer.experts_down, "experts down");
    w->top_k = layer.top_k;
    w->norm_topk_prob = layer.norm_topk_prob;
    w->has_shared = layer.shared_gate.has_value();
    if (w->has_shared) {
        w->shared_gate = get.matrix(layer.shared_gate, "shared expert gate");
        w->shared_up = get.matrix(layer.shared_up, "shared expert up");
        w->shared_down = get.matrix(layer.shared_down, "shared expert down");
        w->shared_expert_gate = get.matrix(layer.shared_expert_gate, "shared_expert_gate");
    }
    return w;
}

// The multi-token-prediction head as Python gives it (see Qwen3_5MTP).
struct PyQwen3_5MTP {
    std::vector<float> embedding_norm, hidden_norm, norm;
    std::optional<Tensor> fc;
    PyQwen3_5Layer layer;
};

Qwen3_5Layer layer_of(const PyQwen3_5Layer& layer, TensorViews& get) {
    Qwen3_5Layer L{};
    L.input_norm = layer.input_norm;
    L.post_attention_norm = layer.post_attention_norm;
    if (layer.kind == "full_attention") {
        L.kind = LayerKind::FullAttention;
        L.q = get.matrix(layer.q, "q_proj");
        L.k = get.matrix(layer.k, "k_proj");
        L.v = get.matrix(layer.v, "v_proj");
        L.o = get.matrix(layer.o, "o_proj");
        L.q_norm = layer.q_norm;
        L.k_norm = layer.k_norm;
    } else if (layer.kind == "linear_attention") {
        L.kind = LayerKind::LinearAttention;
        L.qkv = get.matrix(layer.qkv, "in_proj_qkv");
        L.z = get.matrix(layer.z, "in_proj_z");
        L.b = get.matrix(layer.b, "in_proj_b");
        L.a = get.matrix(layer.a, "in_proj_a");
        L.out = get.matrix(layer.out, "out_proj");
        L.conv = layer.conv;
        L.decay = layer.decay;
        L.dt_bias = layer.dt_bias;
        L.norm = layer.norm;
    } else {
        throw std::invalid_argument(get.at + "kind must be full_attention or linear_attention, got '" + layer.kind +
                                    "'");
    }
    L.is_moe = layer.router.has_value();
    if (L.is_moe) {
        L.moe = moe_weights(layer, get);
    } else {
        L.gate = get.matrix(layer.gate, "gate_proj");
        L.up = get.matrix(layer.up, "up_proj");
        L.down = get.matrix(layer.down, "down_proj");
    }
    return L;
}

}  // namespace

void pocketllm::bind_qwen3_5(nb::module_& m) {
    nb::class_<Qwen3_5Config>(m, "Qwen3_5Config", "Sizes and options of a Qwen3.5 model.")
        .def(nb::init<>())
        .def_rw("vocab_size", &Qwen3_5Config::vocab_size)
        .def_rw("hidden_size", &Qwen3_5Config::hidden_size)
        .def_rw("num_layers", &Qwen3_5Config::num_layers)
        .def_rw("num_heads", &Qwen3_5Config::num_heads)
        .def_rw("num_kv_heads", &Qwen3_5Config::num_kv_heads)
        .def_rw("head_dim", &Qwen3_5Config::head_dim)
        .def_rw("rotary_dim", &Qwen3_5Config::rotary_dim)
        .def_rw("rms_norm_eps", &Qwen3_5Config::rms_norm_eps)
        .def_rw("inv_freq", &Qwen3_5Config::inv_freq)
        .def_rw("rope_attention_factor", &Qwen3_5Config::rope_attention_factor)
        .def_rw("linear_num_k_heads", &Qwen3_5Config::linear_num_k_heads)
        .def_rw("linear_num_v_heads", &Qwen3_5Config::linear_num_v_heads)
        .def_rw("linear_k_dim", &Qwen3_5Config::linear_k_dim)
        .def_rw("linear_v_dim", &Qwen3_5Config::linear_v_dim)
        .def_rw("conv_kernel", &Qwen3_5Config::conv_kernel)
        .def_rw("tiled_heads", &Qwen3_5Config::tiled_heads)
        .def_rw("exact_activations", &Qwen3_5Config::exact_activations)
        .def_prop_rw(
            "kv_cache_dtype",
            [](const Qwen3_5Config& c) { return kv_type_name(c.kv_type); },
            [](Qwen3_5Config& c, const std::string& name) { c.kv_type = parse_kv_type(name); });
    nb::class_<PyQwen3_5Layer>(m, "Qwen3_5Layer", "One layer's tensors: its mixer's and its feed-forward's.")
        .def(nb::init<>())
        .def_rw("kind", &PyQwen3_5Layer::kind)
        .def_rw("input_norm", &PyQwen3_5Layer::input_norm)
        .def_rw("post_attention_norm", &PyQwen3_5Layer::post_attention_norm)
        .def_rw("q_norm", &PyQwen3_5Layer::q_norm)
        .def_rw("k_norm", &PyQwen3_5Layer::k_norm)
        .def_rw("conv", &PyQwen3_5Layer::conv)
        .def_rw("decay", &PyQwen3_5Layer::decay)
        .def_rw("dt_bias", &PyQwen3_5Layer::dt_bias)
        .def_rw("norm", &PyQwen3_5Layer::norm)
        .def_rw("q", &PyQwen3_5Layer::q, nb::arg().none())
        .def_rw("k", &PyQwen3_5Layer::k, nb::arg().none())
        .def_rw("v", &PyQwen3_5Layer::v, nb::arg().none())
        .def_rw("o", &PyQwen3_5Layer::o, nb::arg().none())
        .def_rw("qkv", &PyQwen3_5Layer::qkv, nb::arg().none())
        .def_rw("z", &PyQwen3_5Layer::z, nb::arg().none())
        .def_rw("b", &PyQwen3_5Layer::b, nb::arg().none())
        .def_rw("a", &PyQwen3_5Layer::a, nb::arg().none())
        .def_rw("out", &PyQwen3_5Layer::out, nb::arg().none())
        .def_rw("gate", &PyQwen3_5Layer::gate, nb::arg().none())
        .def_rw("up", &PyQwen3_5Layer::up, nb::arg().none())
        .def_rw("down", &PyQwen3_5Layer::down, nb::arg().none())
        .def_rw("router", &PyQwen3_5Layer::router, nb::arg().none())
        .def_rw("experts_gate", &PyQwen3_5Layer::experts_gate)
        .def_rw("experts_up", &PyQwen3_5Layer::experts_up)
        .def_rw("experts_gate_up", &PyQwen3_5Layer::experts_gate_up, nb::arg().none())
        .def_rw("experts_down", &PyQwen3_5Layer::experts_down)
        .def_rw("shared_gate", &PyQwen3_5Layer::shared_gate, nb::arg().none())
        .def_rw("shared_up", &PyQwen3_5Layer::shared_up, nb::arg().none())
        .def_rw("shared_down", &PyQwen3_5Layer::shared_down, nb::arg().none())
        .def_rw("shared_expert_gate", &PyQwen3_5Layer::shared_expert_gate, nb::arg().none())
        .def_rw("top_k", &PyQwen3_5Layer::top_k)
        .def_rw("norm_topk_prob", &PyQwen3_5Layer::norm_topk_prob);
    nb::class_<PyQwen3_5MTP>(m, "Qwen3_5MTP", "The multi-token-prediction head's tensors.")
        .def(nb::init<>())
        .def_rw("embedding_norm", &PyQwen3_5MTP::embedding_norm)
        .def_rw("hidden_norm", &PyQwen3_5MTP::hidden_norm)
        .def_rw("norm", &PyQwen3_5MTP::norm)
        .def_rw("fc", &PyQwen3_5MTP::fc, nb::arg().none())
        .def_rw("layer", &PyQwen3_5MTP::layer);
    m.def(
        "qwen3_5_model",
        [](const Qwen3_5Config& config, const Tensor& embedding, const std::vector<PyQwen3_5Layer>& layers,
           const std::vector<float>& final_norm, const Tensor& lm_head, int64_t num_blocks, int64_t block_size,
           int64_t num_state_slots, int num_threads, const std::optional<PyQwen3_5MTP>& mtp) {
            PyModel model;
            std::vector<Qwen3_5Layer> built;
            for (const PyQwen3_5Layer& layer : layers) {
                TensorViews get{model, "layer " + std::to_string(built.size()) + " "};
                built.push_back(layer_of(layer, get));
            }
            std::optional<Qwen3_5MTP> head;
            if (mtp) {
                TensorViews get{model, "the multi-token-prediction head's "};
                head = Qwen3_5MTP{mtp->embedding_norm, mtp->hidden_norm, mtp->norm, get.matrix(mtp->fc, "fc"),
                                  layer_of(mtp->layer, get)};
            }
            TensorViews get{model, ""};
            const WeightView embed = get.matrix(embedding, "embedding"), lm = get.matrix(lm_head, "lm_head");
            model.model = std::make_shared<Qwen3_5Model>(config, embed, std::move(built), final_norm, lm, num_blocks,
                                                         block_size, num_state_slots, num_threads, std::move(head));
            return model;
        },
        nb::arg("config"), nb::arg("embedding"), nb::arg("layers"), nb::arg("final_norm"), nb::arg("lm_head"),
        nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("num_state_slots"), nb::arg("num_threads"),
        nb::arg("mtp").none() = nb::none(),
        "A Qwen3.5 Model (the Model class, its forward taking state slots) over the tensors' bytes, read in place.");
}
