#include "pocketllm_cpp/model.h"

#include <stdexcept>
#include <string>

namespace pocketllm {

void Model::save_state(int32_t, float*) const { throw std::logic_error("this model keeps no state"); }

void Model::load_state(int32_t, const float*) { throw std::logic_error("this model keeps no state"); }

std::vector<float> Model::mtp_forward(const std::vector<int32_t>&, const std::vector<float>&,
                                      const std::vector<SequenceSlice>&) {
    throw std::logic_error("this model has no multi-token-prediction head");
}

std::vector<float> Model::mtp_logits(const std::vector<float>&) {
    throw std::logic_error("this model has no multi-token-prediction head");
}

void Model::check(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                  const std::vector<StateCapture>* captures) const {
    static const std::vector<StateCapture> none;
    for (const StateCapture& c : captures ? *captures : none) {
        if (num_state_slots() == 0 || c.out == nullptr || c.slice >= slices.size() || c.tokens <= 0 ||
            c.tokens >= slices[c.slice].num_tokens) {
            throw std::invalid_argument("a state capture needs a model with state, a slice and 0 < tokens < its tokens");
        }
    }
    int64_t total = 0;
    for (const auto& s : slices) {
        if (s.start < 0 || s.num_tokens <= 0) throw std::invalid_argument("a slice needs a start >= 0 and tokens");
        if (s.num_logits < 0 || s.num_logits > s.num_tokens) {
            throw std::invalid_argument("a slice's num_logits must be 0..num_tokens");
        }
        const int64_t end = s.start + s.num_tokens;
        if (static_cast<int64_t>(s.block_table.size()) * block_size_ < end) {
            throw std::invalid_argument("a slice's block table is too short for position " + std::to_string(end - 1));
        }
        for (int64_t p = 0; p < (end + block_size_ - 1) / block_size_; ++p) {
            const int32_t block = s.block_table[static_cast<size_t>(p)];
            if (block < 0 || block >= num_blocks_) {
                throw std::invalid_argument("KV block " + std::to_string(block) + " is out of range");
            }
        }
        if (num_state_slots() > 0 && (s.state_slot < 0 || s.state_slot >= num_state_slots())) {
            throw std::invalid_argument("state slot " + std::to_string(s.state_slot) + " is out of range");
        }
        total += s.num_tokens;
    }
    if (total != static_cast<int64_t>(tokens.size())) {
        throw std::invalid_argument("slices cover " + std::to_string(total) + " tokens, got " +
                                    std::to_string(tokens.size()));
    }
    for (int32_t t : tokens) {
        if (t < 0 || t >= vocab_size_) throw std::invalid_argument("token id " + std::to_string(t) + " is out of range");
    }
}

}  // namespace pocketllm
