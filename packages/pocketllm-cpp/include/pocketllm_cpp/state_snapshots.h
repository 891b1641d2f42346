// Prefix caching for state layers: copies of a request's whole state (every Gated DeltaNet layer's conv and
// recurrent state) at block boundaries, filed under the hash of the prefix that ends there (BlockManager's chain
// hash). A state is a running summary, so it can be copied only where a forward pass has it: where a prompt chunk
// ends (on a block boundary), and inside a chunk where the scheduler asks the pass for a StateCapture (model.h).
// Under a byte budget, as a segmented LRU: a new snapshot is on probation until a request resumes from it, and
// eviction takes probation's least recently used first. So the one-off ends of many prompts cannot flush the
// snapshot of a prefix they all share (32 requests on a 2,048-token prefix filed 32 prompt ends behind it, and
// plain LRU evicted it before the next request came). Resumed snapshots fill at most three quarters of the room;
// the oldest of them goes back on probation past that, so new snapshots always have room to prove themselves.
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

    // Where a snapshot of `key` is written (state_bytes / 4 floats), evicting one to make room; nullptr when `key`
    // is filed already (it becomes the most recent of its segment) or nothing fits.
    float* slot_for(uint64_t key);
    // The snapshot of `key` (which must be filed), now the most recently resumed; counts a hit.
    const float* take(uint64_t key);
    // Forgets `key` (a snapshot filed for a step that failed before writing it); nothing if it is not filed.
    void erase(uint64_t key);

private:
    struct Entry {
        std::vector<float> state;
        bool resumed = false;              // in resumed_, else in probation_
        std::list<uint64_t>::iterator at;  // in its segment
    };
    std::list<uint64_t>& segment(const Entry& entry) { return entry.resumed ? resumed_ : probation_; }
    int64_t capacity_, floats_;
    std::unordered_map<uint64_t, Entry> entries_;
    std::list<uint64_t> probation_, resumed_;  // each: front least recently used
    int64_t hits_ = 0, evictions_ = 0;
};

}  // namespace pocketllm
