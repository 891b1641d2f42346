// One persistent pool of worker threads, created once. A decode step has a few hundred parallel regions (every
// matmul, every attention), so a region must cost microseconds: workers spin on an atomic for a while before
// they sleep on a condition variable, and the caller spins for them to finish.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pocketllm {

class ThreadPool {
public:
    explicit ThreadPool(int num_threads);  // the calling thread is one of them
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return static_cast<int>(workers_.size()) + 1; }
    // Seconds the caller spent waiting for workers after its own range, and regions run (see Profile).
    double wait_seconds() const { return wait_seconds_; }
    int64_t regions() const { return regions_; }
    // Runs fn(begin, end) over [0, n) split into one contiguous range per thread; returns when all are done.
    // The first exception thrown by any range is rethrown here. Not reentrant: one caller at a time.
    void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
    // Runs fn(i) for each i in [0, n), threads taking the next index as they finish one: for items of uneven
    // cost (attention over sequences of different lengths), given largest first.
    void parallel_each(int64_t n, const std::function<void(int64_t)>& fn);

private:
    void work(int index);
    void run_range(int index);

    std::vector<std::thread> workers_;
    const std::function<void(int64_t, int64_t)>* task_ = nullptr;
    int64_t n_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<bool> stopping_{false};
    std::mutex mutex_;  // guards sleeping and the first error
    std::condition_variable wake_;
    std::exception_ptr error_;
    double wait_seconds_ = 0;
    int64_t regions_ = 0;
};

}  // namespace pocketllm
