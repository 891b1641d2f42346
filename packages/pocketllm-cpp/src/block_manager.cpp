#include "pocketllm_cpp/block_manager.h"

#include <algorithm>
#include <stdexcept>

namespace pocketllm {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_caching)
    : block_size_(block_size), prefix_caching_(prefix_caching), blocks_(static_cast<size_t>(num_blocks)) {
    for (int32_t b = static_cast<int32_t>(num_blocks) - 1; b >= 0; --b) empty_.push_back(b);  // block 0 on top
}

uint64_t BlockManager::hash_of(uint64_t parent, const int32_t* tokens) const {
    // FNV-1a over the parent's hash and the block's tokens: a chain, so equal blocks after different prefixes
    // differ. Lookups compare the tokens too.
    uint64_t h = 1469598103934665603ULL ^ parent;
    for (int64_t i = 0; i < block_size_; ++i) {
        h ^= static_cast<uint32_t>(tokens[i]);
        h *= 1099511628211ULL;
    }
    return h;
}

std::vector<int32_t> BlockManager::match(const std::vector<int32_t>& tokens) const {
    std::vector<int32_t> found;
    if (!prefix_caching_ || tokens.empty()) return found;
    const int64_t full = static_cast<int64_t>(tokens.size() - 1) / block_size_;
    uint64_t parent = 0;
    for (int64_t i = 0; i < full; ++i) {
        const int32_t* start = tokens.data() + i * block_size_;
        parent = hash_of(parent, start);
        auto it = cached_.find(parent);
        if (it == cached_.end()) break;
        const Block& block = blocks_[static_cast<size_t>(it->second)];
        if (!std::equal(block.tokens.begin(), block.tokens.end(), start)) break;
        found.push_back(it->second);
    }
    return found;
}

int64_t BlockManager::idle_among(const std::vector<int32_t>& blocks) const {
    return std::count_if(blocks.begin(), blocks.end(), [&](int32_t b) { return blocks_[static_cast<size_t>(b)].refs == 0; });
}

BlockManager::Chain BlockManager::share(const std::vector<int32_t>& blocks, int64_t tokens_queried) {
    if (prefix_caching_) {
        queries_ += tokens_queried;
        hits_ += static_cast<int64_t>(blocks.size()) * block_size_;
    }
    Chain chain;
    for (int32_t b : blocks) {
        Block& block = blocks_[static_cast<size_t>(b)];
        if (block.refs++ == 0) cached_free_.erase(block.free_at);  // a matched block is hashed
        chain = {chain.blocks + 1, block.hash};
    }
    return chain;
}

int32_t BlockManager::allocate() {
    int32_t b;
    if (!empty_.empty()) {
        b = empty_.back();
        empty_.pop_back();
    } else if (!cached_free_.empty()) {
        b = cached_free_.front();  // evicted: its contents are about to be overwritten
        cached_free_.pop_front();
        Block& block = blocks_[static_cast<size_t>(b)];
        auto it = cached_.find(block.hash);
        if (it != cached_.end() && it->second == b) cached_.erase(it);
        block.hashed = false;
        block.tokens.clear();
    } else {
        return -1;
    }
    blocks_[static_cast<size_t>(b)].refs = 1;
    return b;
}

void BlockManager::release(std::vector<int32_t>& blocks) {
    // The sequence's last blocks are freed first, so its prefix (the likeliest to be shared) is evicted last.
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
        Block& block = blocks_[static_cast<size_t>(*it)];
        if (--block.refs > 0) continue;
        if (block.hashed) {
            block.free_at = cached_free_.insert(cached_free_.end(), *it);
        } else {
            empty_.push_back(*it);
        }
    }
    blocks.clear();
}

uint64_t BlockManager::prefix_hash(const std::vector<int32_t>& tokens, Chain chain, int64_t blocks) const {
    if (blocks < chain.blocks || blocks * block_size_ > static_cast<int64_t>(tokens.size())) {
        throw std::logic_error("prefix_hash: blocks outside the chain's continuation");
    }
    for (; chain.blocks < blocks; ++chain.blocks) chain.hash = hash_of(chain.hash, &tokens[static_cast<size_t>(chain.blocks * block_size_)]);
    return chain.hash;
}

void BlockManager::register_full(const std::vector<int32_t>& tokens, int64_t computed,
                                 const std::vector<int32_t>& blocks, Chain& chain) {
    if (!prefix_caching_) return;
    const int64_t full = std::min<int64_t>(computed / block_size_, static_cast<int64_t>(blocks.size()));
    for (; chain.blocks < full; ++chain.blocks) {
        const int32_t b = blocks[static_cast<size_t>(chain.blocks)];
        const auto first = tokens.begin() + chain.blocks * block_size_;
        chain.hash = hash_of(chain.hash, &*first);
        Block& block = blocks_[static_cast<size_t>(b)];
        if (block.hashed) continue;
        block.hashed = true;
        block.hash = chain.hash;
        block.tokens.assign(first, first + block_size_);
        cached_.emplace(chain.hash, b);  // where an equal block is cached already, that one stays the one found
    }
}

}  // namespace pocketllm
