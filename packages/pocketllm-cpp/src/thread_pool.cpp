#include "pocketllm_cpp/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POCKETLLM_PAUSE() _mm_pause()
#else
#define POCKETLLM_PAUSE() std::this_thread::yield()
#endif

namespace pocketllm {
namespace {

// How long an idle worker spins before it sleeps: long enough to span the serial work between two regions of
// a step (norms, RoPE), short enough that an idle engine stops burning a core at once.
constexpr auto kSpin = std::chrono::microseconds(2000);

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
    for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_range(int index) {
    const int64_t threads = size();
    const int64_t begin = n_ * index / threads, end = n_ * (index + 1) / threads;
    if (begin >= end) return;
    try {
        (*task_)(begin, end);
    } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
    }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (workers_.empty() || n <= 1) {
        if (n > 0) fn(0, n);
        return;
    }
    task_ = &fn;
    n_ = n;
    error_ = nullptr;
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1);  // publishes task_ and n_ to the workers
    if (sleepers_.load() > 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        wake_.notify_all();
    }
    run_range(0);
    ++regions_;
    if (pending_.load() > 0) {
        const auto idle = std::chrono::steady_clock::now();
        while (pending_.load() > 0) POCKETLLM_PAUSE();
        wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - idle).count();
    }
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::parallel_each(int64_t n, const std::function<void(int64_t)>& fn) {
    std::atomic<int64_t> next{0};
    parallel_for(std::min<int64_t>(n, size()), [&](int64_t, int64_t) {
        for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    });
}

void ThreadPool::work(int index) {
    uint64_t seen = 0;
    for (;;) {
        const auto deadline = std::chrono::steady_clock::now() + kSpin;
        int spins = 0;
        while (generation_.load() == seen && !stopping_.load()) {
            if (++spins % 1024 == 0 && std::chrono::steady_clock::now() > deadline) {
                std::unique_lock<std::mutex> lock(mutex_);
                sleepers_.fetch_add(1);
                wake_.wait(lock, [&] { return generation_.load() != seen || stopping_.load(); });
                sleepers_.fetch_sub(1);
                break;
            }
            POCKETLLM_PAUSE();
        }
        if (stopping_.load()) return;
        seen = generation_.load();
        run_range(index);
        pending_.fetch_sub(1);
    }
}

}  // namespace pocketllm
