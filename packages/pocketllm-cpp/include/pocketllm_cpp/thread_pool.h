// One persistent pool of worker threads, created once: a parallel region costs a wake-up, not a thread start.
#pragma once

#include <condition_variable>
#include <cstdint>
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
    // Runs fn(begin, end) over [0, n) split into one contiguous range per thread; returns when all are done.
    // The first exception thrown by any range is rethrown here.
    void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

private:
    void work(int index);
    void run_range(int index);

    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable start_, done_;
    const std::function<void(int64_t, int64_t)>* task_ = nullptr;
    int64_t n_ = 0;
    uint64_t generation_ = 0;
    int pending_ = 0;
    bool stopping_ = false;
    std::exception_ptr error_;
};

}  // namespace pocketllm
