#include "pocketllm_cpp/state_snapshots.h"

#include <stdexcept>

namespace pocketllm {

StateSnapshots::StateSnapshots(int64_t budget_bytes, int64_t state_bytes)
    : capacity_(state_bytes > 0 ? budget_bytes / state_bytes : 0), floats_(state_bytes / 4) {
    if (budget_bytes < 0 || state_bytes < 0 || state_bytes % 4 != 0) {
        throw std::invalid_argument("a snapshot budget >= 0 and a state of whole floats are needed");
    }
}

void StateSnapshots::erase(uint64_t key) {
    auto found = entries_.find(key);
    if (found == entries_.end()) return;
    order_.erase(found->second.at);
    entries_.erase(found);
}

float* StateSnapshots::slot_for(uint64_t key) {
    auto found = entries_.find(key);
    if (found != entries_.end()) {
        order_.splice(order_.end(), order_, found->second.at);
        return nullptr;
    }
    if (capacity_ == 0) return nullptr;
    std::vector<float> state;
    if (size() >= capacity_) {  // reuse the evicted snapshot's memory
        auto oldest = entries_.find(order_.front());
        state = std::move(oldest->second.state);
        entries_.erase(oldest);
        order_.pop_front();
        ++evictions_;
    }
    state.resize(static_cast<size_t>(floats_));
    order_.push_back(key);
    Entry& entry = entries_[key] = Entry{std::move(state), std::prev(order_.end())};
    return entry.state.data();
}

const float* StateSnapshots::take(uint64_t key) {
    Entry& entry = entries_.at(key);
    order_.splice(order_.end(), order_, entry.at);
    ++hits_;
    return entry.state.data();
}

}  // namespace pocketllm
