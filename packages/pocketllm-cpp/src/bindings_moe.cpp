// pocketllm_cpp._native.moe_forward: the mixture-of-experts block over tensors given as their raw bytes (a GGUF's
// stacked expert tensors, in place), for tests and users of the kernels.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "moe.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

}  // namespace

void pocketllm::bind_moe(nb::module_& m) {
    m.def(
        "moe_forward",
        [](const Matrix& x, const Tensor& router, const Tensor& gate, const Tensor& up, const Tensor& down,
           int64_t top_k, bool norm_topk_prob, const Tensor* shared_gate, const Tensor* shared_up,
           const Tensor* shared_down, const Tensor* shared_expert_gate, bool exact) {
            const int64_t n = static_cast<int64_t>(x.shape(0)), hidden = static_cast<int64_t>(x.shape(1));
            MoeWeights w{};
            w.router = matrices(router, 2, "moe router")[0];
            w.gate = matrices(gate, 3, "moe gate");
            w.up = matrices(up, 3, "moe up");
            w.down = matrices(down, 3, "moe down");
            w.top_k = top_k;
            w.norm_topk_prob = norm_topk_prob;
            const int given = (shared_gate != nullptr) + (shared_up != nullptr) + (shared_down != nullptr) +
                              (shared_expert_gate != nullptr);
            if (given != 0 && given != 4) {
                throw std::invalid_argument("moe shared expert needs shared_gate, shared_up, shared_down and "
                                            "shared_expert_gate, or none of them");
            }
            w.has_shared = given == 4;
            if (w.has_shared) {
                w.shared_gate = matrices(*shared_gate, 2, "moe shared_gate")[0];
                w.shared_up = matrices(*shared_up, 2, "moe shared_up")[0];
                w.shared_down = matrices(*shared_down, 2, "moe shared_down")[0];
                w.shared_expert_gate = matrices(*shared_expert_gate, 2, "moe shared_expert_gate")[0];
            }
            validate(w, hidden);
            auto out = new_matrix(n, hidden);
            {
                nb::gil_scoped_release released;
                moe_forward(w, x.data(), n, hidden, out.data(), default_pool(), exact);
            }
            return out;
        },
        nb::arg("x"), nb::arg("router"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::kw_only(),
        nb::arg("top_k"), nb::arg("norm_topk_prob") = true, nb::arg("shared_gate").none() = nb::none(),
        nb::arg("shared_up").none() = nb::none(), nb::arg("shared_down").none() = nb::none(),
        nb::arg("shared_expert_gate").none() = nb::none(), nb::arg("exact") = false,
        "The MoE block on x [n, hidden]: router [experts, hidden]; gate, up [experts, ff, hidden] and down "
        "[experts, hidden, ff] stacked; the shared expert's gate, up [shared_ff, hidden], down [hidden, shared_ff] "
        "and sigmoid gate [1, hidden], all or none.");
}
