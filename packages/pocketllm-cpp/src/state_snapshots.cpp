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
    segment(found->second).erase(found->second.at);
    entries_.erase(found);
}

float* StateSnapshots::slot_for(uint64_t key) {
    auto found = entries_.find(key);
    if (found != entries_.end()) {
        std::list<uint64_t>& in = segment(found->second);
        in.splice(in.end(), in, found->second.at);
        return nullptr;
    }
    if (capacity_ == 0) return nullptr;
    std::vector<float> state;
    if (size() >= capacity_) {  // reuse the evicted snapshot's memory: probation's oldest, else the oldest resumed
        std::list<uint64_t>& from = probation_.empty() ? resumed_ : probation_;
        auto oldest = entries_.find(from.front());
        state = std::move(oldest->second.state);
        entries_.erase(oldest);
        from.pop_front();
        ++evictions_;
    }
    state.resize(static_cast<size_t>(floats_));
    probation_.push_back(key);
    Entry& entry = entries_[key] = Entry{std::move(state), false, std::prev(probation_.end())};
    return entry.state.data();
}

const float* StateSnapshots::take(uint64_t key) {
    Entry& entry = entries_.at(key);
    resumed_.splice(resumed_.end(), segment(entry), entry.at);
    entry.resumed = true;
    // Past three quarters of the room, the oldest resumed snapshot goes back on probation, as its newest.
    while (static_cast<int64_t>(resumed_.size()) > capacity_ - capacity_ / 4) {
        Entry& oldest = entries_.at(resumed_.front());
        probation_.splice(probation_.end(), resumed_, oldest.at);
        oldest.resumed = false;
    }
    ++hits_;
    return entry.state.data();
}

}  // namespace pocketllm
