// Prefix caching for state layers: copies of a request's whole state (every Gated DeltaNet layer's conv and
// recurrent state) at block boundaries, filed under the hash of the prefix that ends there (BlockManager's chain
// hash). A state is a running summary, so it can be copied only where a forward pass has it: where a prompt chunk
// ends (on a block boundary), and inside a chunk where the scheduler asks the pass for a StateCapture (model.h).
// Least recently used first out, under a byte budget.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace pocketllm {

class StateSnapshots {
public:
    // Room for budget_bytes / state_bytes snapshots (0: none are kept).
    StateSnapshots(int64_t budget_bytes, int64_t state_bytes);

    bool contains(uint64_t key) const { return entries_.count(key) != 0; }
    int64_t capacity() const { return capacity_; }
    int64_t size() const { return static_cast<int64_t>(entries_.size()); }
    int64_t hits() const { return hits_; }
    int64_t evictions() const { return evictions_; }

    // Where a snapshot of `key` is written (state_bytes / 4 floats), evicting the least recently used one to make
    // room; nullptr when `key` is filed already (it becomes the most recent) or nothing fits.
    float* slot_for(uint64_t key);
    // The snapshot of `key` (which must be filed), now the most recently used; counts a hit.
    const float* take(uint64_t key);
    // Forgets `key` (a snapshot filed for a step that failed before writing it); nothing if it is not filed.
    void erase(uint64_t key);

private:
    struct Entry {
        std::vector<float> state;
        std::list<uint64_t>::iterator at;  // in order_
    };
    int64_t capacity_, floats_;
    std::unordered_map<uint64_t, Entry> entries_;
    std::list<uint64_t> order_;  // front: least recently used
    int64_t hits_ = 0, evictions_ = 0;
};

}  // namespace pocketllm
