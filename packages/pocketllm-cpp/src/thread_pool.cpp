#include "pocketllm_cpp/thread_pool.h"

#include <algorithm>

namespace pocketllm {

ThreadPool::ThreadPool(int num_threads) {
    for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    start_.notify_all();
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
    {
        std::lock_guard<std::mutex> lock(mutex_);
        task_ = &fn;
        n_ = n;
        pending_ = static_cast<int>(workers_.size());
        error_ = nullptr;
        ++generation_;
    }
    start_.notify_all();
    run_range(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::work(int index) {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mutex_);
            start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
            if (stopping_) return;
            seen = generation_;
        }
        run_range(index);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            --pending_;
        }
        done_.notify_one();
    }
}

}  // namespace pocketllm
