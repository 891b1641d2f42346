// The KV block pool: reference-counted blocks; free blocks holding no cached prefix, reused most recently freed
// first (their pages are resident already: a pool sized for the worst case costs memory only as far as it is
// used); free blocks holding a cached prefix, evicted least recently freed first; and (with prefix caching) a map
// from the hash of each full block's tokens, prefix included, to the block that holds them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace pocketllm {

class BlockManager {
public:
    BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_caching);

    int64_t block_size() const { return block_size_; }
    int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
    int64_t num_free() const { return static_cast<int64_t>(empty_.size() + cached_free_.size()); }

    // The cached blocks holding a prefix of `tokens`: whole blocks only, and never the last token (its logits
    // must be computed). Changes nothing.
    std::vector<int32_t> match(const std::vector<int32_t>& tokens) const;
    // Free blocks that taking `blocks` (from match) would use up: cached blocks no sequence holds now.
    int64_t idle_among(const std::vector<int32_t>& blocks) const;
    // A free block: one holding no cached prefix if any, else the least recently freed cached one, evicted;
    // -1 when none is free.
    int32_t allocate();
    // Drops a sequence's references; blocks nobody holds become free, the cached ones keeping their hash.
    void release(std::vector<int32_t>& blocks);
    // A sequence's progress in registering its full blocks: how many, and the hash of the last.
    struct Chain {
        int64_t blocks = 0;
        uint64_t hash = 0;
    };
    // Takes a reference on each of `blocks` (from match), counts the lookup in the stats, and returns the chain
    // of a sequence that starts with them.
    Chain share(const std::vector<int32_t>& blocks, int64_t tokens_queried);
    // Records the hashes of a sequence's blocks that are now full of computed tokens (blocks[i] holds tokens
    // [i * block_size, (i + 1) * block_size)), continuing `chain`.
    void register_full(const std::vector<int32_t>& tokens, int64_t computed, const std::vector<int32_t>& blocks,
                       Chain& chain);

    // The hash register_full will give the prefix tokens[0, blocks * block_size), continuing `chain` (blocks >=
    // chain.blocks): where a snapshot of the state there is filed before the step that reaches it.
    uint64_t prefix_hash(const std::vector<int32_t>& tokens, Chain chain, int64_t blocks) const;
    // The prefix hash of a block that match() returned (its chain's hash where it ends).
    uint64_t hash(int32_t block) const { return blocks_[static_cast<size_t>(block)].hash; }

    int64_t queries() const { return queries_; }
    int64_t hits() const { return hits_; }

private:
    struct Block {
        int32_t refs = 0;
        bool hashed = false;
        uint64_t hash = 0;
        std::vector<int32_t> tokens;  // of a hashed block: compared on lookup, so a hash collision is a miss
        std::list<int32_t>::iterator free_at;  // in cached_free_, while free and hashed
    };
    uint64_t hash_of(uint64_t parent, const int32_t* tokens) const;

    int64_t block_size_;
    bool prefix_caching_;
    std::vector<Block> blocks_;
    std::vector<int32_t> empty_;      // free, no cached prefix: a stack, the most recently freed on top
    std::list<int32_t> cached_free_;  // free, cached prefix: front freed longest ago, evicted first
    std::unordered_map<uint64_t, int32_t> cached_;
    int64_t queries_ = 0, hits_ = 0;
};

}  // namespace pocketllm
