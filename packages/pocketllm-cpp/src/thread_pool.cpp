#include "pocketllm_cpp/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POCKETLLM_PAUSE() _mm_pause()
#else
#define POCKETLLM_PAUSE() std::this_thread::yield()
#endif

#ifdef __linux__
#include <sched.h>
#endif

namespace pocketllm {

using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kChunksPerThread = 4;  // small enough that a late or descheduled thread leaves little undone
constexpr uint64_t kMaxChunks = 0xFFFF;  // what claim_'s fields hold

uint64_t claim_word(uint32_t generation, uint64_t chunks, uint64_t next) {
    return static_cast<uint64_t>(generation) << 32 | chunks << 16 | next;
}

}  // namespace

bool Spinner::wait(const std::function<bool()>& ready) {
    const Clock::time_point start = Clock::now();
    const Clock::time_point spin_end = start + limit_;
    for (int64_t i = 1;; ++i) {
        if (ready()) {
            // Spinning paid: spin as long again next time, and longer, back up to kSpin.
            limit_ = std::min<Clock::duration>(kSpin, limit_ * 2 + std::chrono::microseconds(1));
            return true;
        }
        POCKETLLM_PAUSE();
        if (i % 16 == 0 && Clock::now() > spin_end) break;  // a clock read costs a few pauses
    }
    limit_ /= 2;
    const Clock::time_point yield_end = Clock::now() + kYield;
    while (!ready()) {
        if (Clock::now() > yield_end) return false;
        std::this_thread::yield();
    }
    return true;
}

ThreadPool::ThreadPool(int num_threads) {
    for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this] { work(); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
}

void ThreadPool::help(uint32_t generation) {
    uint64_t word = claim_.load();
    for (;;) {
        const uint64_t chunks = (word >> 16) & kMaxChunks, chunk = word & kMaxChunks;
        if (static_cast<uint32_t>(word >> 32) != generation || chunk >= chunks) return;
        if (!claim_.compare_exchange_weak(word, word + 1)) continue;  // `word` is reloaded
        const int64_t begin = n_ * static_cast<int64_t>(chunk) / static_cast<int64_t>(chunks);
        const int64_t end = n_ * static_cast<int64_t>(chunk + 1) / static_cast<int64_t>(chunks);
        try {
            if (begin < end) (*task_)(begin, end);
        } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!error_) error_ = std::current_exception();
        }
        // The last chunk wakes a sleeping caller. Both sides are sequentially consistent: either this sees the
        // caller's flag and notifies under the mutex, or the caller's predicate sees this increment.
        if (completed_.fetch_add(1) + 1 == static_cast<int64_t>(chunks) && caller_asleep_.load()) {
            std::lock_guard<std::mutex> lock(mutex_);
            done_.notify_one();
        }
        word = claim_.load();
    }
}

void ThreadPool::run(int64_t n, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn) {
    chunks = std::min<int64_t>({chunks, n, static_cast<int64_t>(kMaxChunks)});
    if (workers_.empty() || chunks <= 1) {
        if (n > 0) fn(0, n);
        return;
    }
    task_ = &fn;
    n_ = n;
    error_ = nullptr;
    completed_.store(0);
    claim_.store(claim_word(++generation_, static_cast<uint64_t>(chunks), 0));  // publishes task_ and n_
    if (sleepers_.load() > 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        wake_.notify_all();
    }
    help(generation_);
    ++regions_;
    const std::function<bool()> finished = [this, chunks] { return completed_.load() == chunks; };
    if (!finished()) {
        const Clock::time_point idle = Clock::now();
        if (!spinner_.wait(finished)) {
            std::unique_lock<std::mutex> lock(mutex_);
            caller_asleep_.store(true);
            done_.wait(lock, finished);
            caller_asleep_.store(false);
        }
        wait_seconds_ += std::chrono::duration<double>(Clock::now() - idle).count();
    }
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    run(n, size() * kChunksPerThread, fn);
}

void ThreadPool::parallel_each(int64_t n, const std::function<void(int64_t)>& fn) {
    run(n, n, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) fn(i);
    });
}

void ThreadPool::work() {
    uint32_t seen = 0;
    const std::function<bool()> moved = [&] {
        return static_cast<uint32_t>(claim_.load() >> 32) != seen || stopping_.load();
    };
    Spinner spinner;
    for (;;) {
        if (!spinner.wait(moved)) {
            std::unique_lock<std::mutex> lock(mutex_);
            sleepers_.fetch_add(1);
            wake_.wait(lock, moved);
            sleepers_.fetch_sub(1);
        }
        if (stopping_.load()) return;
        seen = static_cast<uint32_t>(claim_.load() >> 32);
        help(seen);
    }
}

namespace {

std::string first_line(const std::string& path) {
    std::ifstream file(path);
    std::string line;
    std::getline(file, line);
    return line;
}

std::vector<std::string> split(const std::string& text, char separator) {
    std::vector<std::string> parts;
    std::istringstream in(text);
    for (std::string part; std::getline(in, part, separator);) parts.push_back(part);
    return parts;
}

// A positive number from the start of `text`, else 0 ("max", "-1", empty: no limit).
double positive(const std::string& text) {
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    return end != text.c_str() && value > 0 && std::isfinite(value) ? value : 0.0;
}

// The CPUs a cgroup's own files allow, 0 for none: v2's "quota period" (or "max period") in cpu.max, v1's two files.
double quota_at(const std::string& dir, bool v2) {
    if (v2) {
        const std::vector<std::string> fields = split(first_line(dir + "/cpu.max"), ' ');
        if (fields.size() != 2) return 0.0;
        const double quota = positive(fields[0]), period = positive(fields[1]);
        return quota > 0 && period > 0 ? quota / period : 0.0;
    }
    const double quota = positive(first_line(dir + "/cpu.cfs_quota_us"));
    const double period = positive(first_line(dir + "/cpu.cfs_period_us"));
    return quota > 0 && period > 0 ? quota / period : 0.0;
}

// The smallest quota from the process's cgroup up to the top of the hierarchy's mount at `point`. `mount_root` is
// the cgroup the mount shows at its top (in a container, usually the container's own): a process path outside it
// is not visible there, and the mount's top is the nearest cgroup that is.
double hierarchy_quota(const std::string& root, const std::string& point, const std::string& mount_root,
                       const std::string& path, bool v2) {
    std::string relative;
    if (mount_root == "/") relative = path;
    else if (path.compare(0, mount_root.size(), mount_root) == 0) relative = path.substr(mount_root.size());
    double smallest = 0.0;
    for (;;) {
        const double quota = quota_at(root + point + relative, v2);
        if (quota > 0 && (smallest == 0 || quota < smallest)) smallest = quota;
        const size_t slash = relative.find_last_of('/');
        if (relative.empty() || slash == std::string::npos) break;
        relative.resize(slash);
    }
    return smallest;
}

}  // namespace

double cgroup_cpu_quota(const std::string& root) {
    // This process's cgroup per hierarchy: "0::/path" (v2), "4:cpu,cpuacct:/path" (v1).
    std::string v2_path, v1_path;
    bool v2 = false, v1 = false;
    std::ifstream cgroups(root + "/proc/self/cgroup");
    for (std::string line; std::getline(cgroups, line);) {
        const size_t first = line.find(':'), second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) continue;
        const std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
        const std::vector<std::string> names = split(controllers, ',');
        if (line.compare(0, first, "0") == 0 && controllers.empty()) {
            v2 = true, v2_path = path;
        } else if (std::find(names.begin(), names.end(), "cpu") != names.end()) {
            v1 = true, v1_path = path;
        }
    }
    // Where those hierarchies are mounted: mountinfo's 4th (the cgroup at the mount's top) and 5th (the mount
    // point) fields, the file system type and its options after the " - " separator.
    double smallest = 0.0;
    std::ifstream mounts(root + "/proc/self/mountinfo");
    for (std::string line; std::getline(mounts, line);) {
        const std::vector<std::string> fields = split(line, ' ');
        const auto dash = std::find(fields.begin(), fields.end(), "-");
        if (fields.size() < 5 || fields.end() - dash < 4) continue;
        const std::string& type = dash[1];
        const std::vector<std::string> options = split(dash[3], ',');
        double quota = 0.0;
        if (type == "cgroup2" && v2) {
            quota = hierarchy_quota(root, fields[4], fields[3], v2_path, true);
        } else if (type == "cgroup" && v1 && std::find(options.begin(), options.end(), "cpu") != options.end()) {
            quota = hierarchy_quota(root, fields[4], fields[3], v1_path, false);
        }
        if (quota > 0 && (smallest == 0 || quota < smallest)) smallest = quota;
    }
    return smallest;
}

int available_cpus() {
    int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
#endif
    const double quota = cgroup_cpu_quota();
    if (quota > 0) cpus = std::min(cpus, std::max(1, static_cast<int>(std::ceil(quota))));
    return cpus;
}

}  // namespace pocketllm
