// zen_ds CUDA emulation: runs the kernels of zen_ops_cuda_kernels.cuh on the CPU, for tests only.
//
// A launch runs its grid's blocks in turn. A block's threads are real std::threads (a pool reused
// by every launch), so the kernels' concurrency is real: __syncthreads is a barrier over the block's live threads (a thread
// that returned no longer counts, as on the GPU), a warp collective (__any_sync, __ballot_sync,
// __match_any_sync, __syncwarp) waits for every lane its mask names, dynamic shared memory is one
// buffer per block filled with garbage at block start, atomics are std::atomic_ref operations.
//
// Misuse the GPU would turn into a hang or undefined behaviour raises instead: a deadlock (every
// live thread of a block waiting, e.g. __syncthreads in divergent code), a warp collective whose
// lanes disagree on the mask or one of whose lanes has exited, too much shared memory, too big a
// block. The error names the kernel. A warp runs one collective at a time (the kernels use full
// masks; concurrent collectives of disjoint sub-warp groups are reported as divergent).
//
// Fault injection (set_fault("nonatomic")): atomic read-modify-writes lose their atomicity. Each
// thread's RMWs read memory as it was at the block's last barrier (plus the thread's own earlier
// RMWs) and are written back when the next __syncthreads completes, or when the block ends, in
// thread order:
// the schedule a warp executing a plain read-then-write in lockstep produces. A test proves with it
// that its inputs contend, i.e. that a kernel missing an atomic would be caught.
// set_fault("warp_prefix_skips_warp0") turns on the kernels' one mutation point (an off-by-one in
// the partition's per-warp prefix; see ZEN_MUTATION_WARP_PREFIX_FIRST) without a second build.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct uint3 {
    unsigned int x = 0, y = 0, z = 0;
};
using dim3 = uint3;
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

// The built-in variables: per CPU thread, set before it runs its part of a block.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace zen_emu {

constexpr size_t kMaxSharedBytes = 48 * 1024;  // dynamic shared memory without an opt-in
constexpr int kMaxBlockThreads = 1024;

enum class Fault { none, nonatomic, warp_prefix_skips_warp0 };

// Unwinds a thread whose block was aborted by another thread's error.
struct Aborted {
};

class Block;
inline thread_local Block* current_block = nullptr;

// One pending plain read-modify-write (fault "nonatomic"): its address, width and new value.
struct PendingWrite {
    void* address;
    size_t bytes;
    uint64_t value;
};

class Block {
   public:
    Block(int threads, size_t shared_bytes, Fault fault)
        : threads_(threads), shared_(shared_bytes + 16), fault_(fault),
          warps_((threads + 31) / 32), pending_(threads)
    {
    }

    // Called by the launcher, with no thread running, before each block.
    void reset()
    {
        live_ = threads_;
        arrived_ = 0;
        blocked_ = 0;
        for (size_t w = 0; w < warps_.size(); ++w) {
            Warp& warp = warps_[w];
            warp.arrived = warp.mask = 0;
            warp.what.clear();
            const int lanes = std::min(32, threads_ - static_cast<int>(w) * 32);
            warp.exited = lanes == 32 ? 0u : ~((1u << lanes) - 1u);  // lanes that do not exist
        }
        std::memset(shared_.data(), 0xA5, shared_.size());  // shared memory starts as garbage
    }

    void* shared() { return align16(shared_.data()); }
    Fault fault() const { return fault_; }
    bool failed() const { return !error_.empty(); }
    const std::string& error() const { return error_; }

    // A thread of the block failed (or found misuse): every thread unwinds, the launch raises.
    void fail(const std::string& why)
    {
        std::lock_guard<std::mutex> lock(mutex_);
        abort_locked(why);
    }

    void syncthreads(int thread)
    {
        std::unique_lock<std::mutex> lock(mutex_);
        throw_if_aborted();
        if (++arrived_ == live_) {
            release_barrier_locked(arrived_ - 1);
            return;
        }
        const uint64_t generation = barrier_generation_;
        wait_locked(lock, cv_, [&] { return barrier_generation_ != generation; }, "__syncthreads");
    }

    // Warp collective over the lanes in `mask`: every lane contributes `value`; returns all lanes'
    // values in `out` (indexed by lane).
    void warp_exchange(int thread, const char* what, uint32_t mask, uint64_t value, uint64_t* out)
    {
        std::unique_lock<std::mutex> lock(mutex_);
        throw_if_aborted();
        Warp& warp = warps_[thread / 32];
        const uint32_t lane_bit = 1u << (thread % 32);
        if (!(mask & lane_bit)) abort_locked(std::string(what) + ": the calling lane is not in its mask");
        if (mask & warp.exited)
            abort_locked(std::string(what) + ": a lane named in the mask has exited or does not exist");
        if (warp.arrived == 0) {
            warp.mask = mask;
            warp.what = what;
        } else if (warp.mask != mask || warp.what != what) {
            abort_locked(std::string("divergent warp collective: ") + what + " with mask " +
                         std::to_string(mask) + " while other lanes wait in " + warp.what +
                         " with mask " + std::to_string(warp.mask));
        }
        warp.values[thread % 32] = value;
        warp.arrived |= lane_bit;
        if (warp.arrived == mask) {
            std::copy(std::begin(warp.values), std::end(warp.values), warp.result);
            blocked_ -= __builtin_popcount(mask) - 1;
            warp.arrived = 0;
            ++warp.generation;
            warp.cv.notify_all();
        } else {
            const uint64_t generation = warp.generation;
            wait_locked(lock, warp.cv, [&] { return warp.generation != generation; }, what);
        }
        std::copy(std::begin(warp.result), std::end(warp.result), out);
    }

    // The thread returned from the kernel (or unwound).
    void exit_thread(int thread)
    {
        std::lock_guard<std::mutex> lock(mutex_);
        --live_;
        Warp& warp = warps_[thread / 32];
        const uint32_t lane_bit = 1u << (thread % 32);
        warp.exited |= lane_bit;
        if (error_.empty() && warp.arrived != 0 && (warp.mask & lane_bit))
            set_error_locked(std::string("lane ") + std::to_string(thread % 32) + " of warp " +
                         std::to_string(thread / 32) + " exited while its warp waits in " +
                         warp.what);
        if (arrived_ > 0 && arrived_ == live_) release_barrier_locked(arrived_);
        check_deadlock_locked();
    }

    // Fault "nonatomic": the RMW reads the thread's own pending value, else memory.
    template <typename T, typename Op>
    T plain_rmw(int thread, T* address, Op op)
    {
        std::vector<PendingWrite>& mine = pending_[thread];
        for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
            if (it->address == address) {
                T old;
                std::memcpy(&old, &it->value, sizeof(T));
                const T updated = op(old);
                std::memcpy(&it->value, &updated, sizeof(T));
                return old;
            }
        }
        const T old = std::atomic_ref<T>(*address).load(std::memory_order_relaxed);
        PendingWrite write{address, sizeof(T), 0};
        const T updated = op(old);
        std::memcpy(&write.value, &updated, sizeof(T));
        mine.push_back(write);
        return old;
    }

    // Called by the launcher when the block's threads are all done.
    void flush_all()
    {
        for (int t = 0; t < threads_; ++t) flush_locked(t);
    }

   private:
    struct Warp {
        uint32_t arrived = 0;  // lanes waiting in the current collective
        uint32_t mask = 0;
        uint32_t exited = 0;
        uint64_t generation = 0;
        std::string what;
        uint64_t values[32] = {};
        uint64_t result[32] = {};
        std::condition_variable cv;  // lanes waiting in a collective
    };

    static void* align16(unsigned char* p)
    {
        return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15));
    }

    void throw_if_aborted()
    {
        if (!error_.empty()) throw Aborted{};
    }

    void set_error_locked(const std::string& why)
    {
        if (error_.empty()) error_ = why;
        cv_.notify_all();
        for (Warp& warp : warps_) warp.cv.notify_all();
    }

    void abort_locked(const std::string& why)
    {
        set_error_locked(why);
        throw Aborted{};
    }

    // `waiters`: the arrived threads that wait (all of them when an exit completes the barrier).
    void release_barrier_locked(int waiters)
    {
        for (int t = 0; t < threads_; ++t) flush_locked(t);  // fault "nonatomic" only
        blocked_ -= waiters;
        arrived_ = 0;
        ++barrier_generation_;
        cv_.notify_all();
    }

    template <typename Done>
    void wait_locked(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done,
                     const char* what)
    {
        ++blocked_;
        check_deadlock_locked(what);
        cv.wait(lock, [&] { return done() || !error_.empty(); });
        if (!done()) throw Aborted{};
    }

    void check_deadlock_locked(const char* what = "exit")
    {
        if (error_.empty() && live_ > 0 && blocked_ >= live_)
            set_error_locked(std::string("deadlock: every live thread of the block waits (last: ") +
                             what + "); __syncthreads or a warp collective in divergent code?");
    }

    void flush_locked(int thread)
    {
        for (const PendingWrite& write : pending_[thread])
            std::memcpy(write.address, &write.value, write.bytes);
        pending_[thread].clear();
    }

    const int threads_;
    std::vector<unsigned char> shared_;
    const Fault fault_;
    std::vector<Warp> warps_;
    std::vector<std::vector<PendingWrite>> pending_;
    std::mutex mutex_;
    std::condition_variable cv_;
    int live_ = 0;
    int arrived_ = 0;  // threads waiting in (or arriving at) the current __syncthreads
    int blocked_ = 0;  // threads waiting on any barrier that has not completed
    uint64_t barrier_generation_ = 0;
    std::string error_;
};

// ------------------------------------------------------------------ process-wide state

struct Registry {
    std::mutex mutex;
    std::map<std::string, int64_t> launches;  // kernel name -> launches
    Fault fault = Fault::none;
};

inline Registry& registry()
{
    static Registry instance;
    return instance;
}

inline void set_fault(const std::string& name)
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    if (name == "none") registry().fault = Fault::none;
    else if (name == "nonatomic") registry().fault = Fault::nonatomic;
    else if (name == "warp_prefix_skips_warp0") registry().fault = Fault::warp_prefix_skips_warp0;
    else throw std::invalid_argument("zen_ds emulation: unknown fault '" + name +
                                     "' (none, nonatomic, warp_prefix_skips_warp0)");
}

inline std::map<std::string, int64_t> launch_counts()
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    return registry().launches;
}

inline void reset_launch_counts()
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    registry().launches.clear();
}

// ------------------------------------------------------------------ launch

inline thread_local int current_thread = 0;  // flat thread index inside the block

// The CPU threads that play a block's threads: created once per process (as many as the largest
// block so far) and reused by every launch, since creating hundreds of threads per launch costs
// more than the kernels. Launches are serialised. A forked child starts a new pool.
class ThreadPool {
   public:
    static ThreadPool& instance()
    {
        static ThreadPool* pool = new ThreadPool();  // never destroyed: its threads are detached
        return *pool;
    }

    // Runs job(t) for t in [0, threads) concurrently, one pool thread each; returns when all ran.
    void run(int threads, const std::function<void(int)>& job)
    {
        std::lock_guard<std::mutex> launch(launch_mutex_);
        std::unique_lock<std::mutex> lock(mutex_);
        if (pid_ != getpid()) {  // forked: the parent's threads do not exist here
            state_ = std::make_shared<State>();
            pid_ = getpid();
        }
        std::shared_ptr<State> state = state_;
        while (state->size < threads) {
            std::thread(&ThreadPool::loop, state, state->size++).detach();
        }
        state->job = &job;
        state->active = threads;
        state->finished = 0;
        ++state->generation;
        state->start.notify_all();
        state->done.wait(lock, [&] { return state->finished == state->active; });
        state->job = nullptr;
    }

   private:
    struct State {
        std::condition_variable start;
        std::condition_variable done;
        const std::function<void(int)>* job = nullptr;
        uint64_t generation = 0;
        int size = 0;
        int active = 0;
        int finished = 0;
    };

    ThreadPool() : pid_(getpid()), state_(std::make_shared<State>()) {}

    static void loop(std::shared_ptr<State> state, int index)
    {
        ThreadPool& pool = instance();
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* job;
            {
                std::unique_lock<std::mutex> lock(pool.mutex_);
                state->start.wait(lock, [&] { return state->generation != seen && index < state->active; });
                seen = state->generation;
                job = state->job;
            }
            (*job)(index);
            std::lock_guard<std::mutex> lock(pool.mutex_);
            if (++state->finished == state->active) state->done.notify_one();
        }
    }

    std::mutex launch_mutex_;
    std::mutex mutex_;
    pid_t pid_;
    std::shared_ptr<State> state_;
};

// Runs body() as every thread of every block of the grid; blocks in turn, threads concurrently.
template <typename Body>
void run_grid(const char* name, int64_t grid, int64_t block, size_t shared_bytes, Body body)
{
    TORCH_CHECK(grid >= 1 && grid <= INT32_MAX, "zen_ds emulation: ", name, ": grid of ", grid,
                " blocks");
    TORCH_CHECK(block >= 1 && block <= kMaxBlockThreads, "zen_ds emulation: ", name, ": block of ",
                block, " threads");
    TORCH_CHECK(shared_bytes <= kMaxSharedBytes, "zen_ds emulation: ", name, " asks ", shared_bytes,
                " bytes of dynamic shared memory; a launch gets ", kMaxSharedBytes,
                " without cudaFuncSetAttribute");
    Fault fault;
    {
        std::lock_guard<std::mutex> lock(registry().mutex);
        ++registry().launches[name];
        fault = registry().fault;
    }
    const int threads = static_cast<int>(block);
    Block state(threads, shared_bytes, fault);
    int64_t b = 0;
    const std::function<void(int)> run_thread = [&](int t) {
        threadIdx = uint3{static_cast<unsigned int>(t), 0, 0};
        blockIdx = uint3{static_cast<unsigned int>(b), 0, 0};
        blockDim = dim3{static_cast<unsigned int>(threads), 1, 1};
        gridDim = dim3{static_cast<unsigned int>(grid), 1, 1};
        current_block = &state;
        current_thread = t;
        try {
            body();
        } catch (const Aborted&) {
        } catch (const std::exception& e) {
            try {
                state.fail(e.what());
            } catch (const Aborted&) {
            }
        }
        state.exit_thread(t);
        current_block = nullptr;
    };
    std::string error;
    for (; b < grid && error.empty(); ++b) {
        state.reset();
        ThreadPool::instance().run(threads, run_thread);
        state.flush_all();
        if (state.failed()) error = state.error();
    }
    TORCH_CHECK(error.empty(), "zen_ds emulation: kernel ", name, ": ", error);
}

// ZEN_LAUNCH(grid, block, shmem, stream, kernel)(args...): arguments are converted to the
// kernel's parameter types and copied, as a real launch does.
template <typename... Params>
struct Launch {
    const char* name;
    int64_t grid;
    int64_t block;
    size_t shared_bytes;
    void (*kernel)(Params...);

    template <typename... Args>
    void operator()(Args&&... args) const
    {
        static_assert(sizeof...(Args) == sizeof...(Params), "kernel argument count");
        std::tuple<std::decay_t<Params>...> copies(static_cast<std::decay_t<Params>>(args)...);
        auto fn = kernel;
        run_grid(name, grid, block, shared_bytes, [&] { std::apply(fn, copies); });
    }
};

template <typename... Params>
Launch<Params...> make_launch(const char* name, int64_t grid, int64_t block, size_t shared_bytes,
                              void (*kernel)(Params...))
{
    return Launch<Params...>{name, grid, block, shared_bytes, kernel};
}

inline Block& block_of_caller()
{
    TORCH_CHECK(current_block != nullptr, "zen_ds emulation: a device function ran outside a kernel");
    return *current_block;
}

}  // namespace zen_emu

// ------------------------------------------------------------------ the CUDA built-ins

inline void __syncthreads() { zen_emu::block_of_caller().syncthreads(zen_emu::current_thread); }

inline void __syncwarp(unsigned int mask = 0xffffffffu)
{
    uint64_t values[32];
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__syncwarp", mask, 0, values);
}

inline unsigned int __ballot_sync(unsigned int mask, int predicate)
{
    uint64_t values[32];
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__ballot_sync", mask,
                                             predicate != 0, values);
    unsigned int ballot = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1u) && values[lane]) ballot |= 1u << lane;
    return ballot;
}

inline int __any_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }

inline int __all_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

template <typename T>
unsigned int __match_any_sync(unsigned int mask, T value)
{
    static_assert(std::is_integral<T>::value && sizeof(T) <= 8, "__match_any_sync takes 32/64-bit ints");
    uint64_t values[32];
    uint64_t mine = 0;
    std::memcpy(&mine, &value, sizeof(T));
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__match_any_sync", mask, mine,
                                             values);
    unsigned int peers = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1u) && values[lane] == mine) peers |= 1u << lane;
    return peers;
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }

namespace zen_emu {

template <typename T, typename Op, typename Atomic>
T rmw(T* address, Op op, Atomic atomic)
{
    Block& block = block_of_caller();
    if (block.fault() == Fault::nonatomic) return block.plain_rmw(current_thread, address, op);
    return atomic(std::atomic_ref<T>(*address));
}

}  // namespace zen_emu

// The kernels' mutation point (zen_ops_cuda_kernels.cuh): wrong only under that fault.
#define ZEN_MUTATION_WARP_PREFIX_FIRST \
    (zen_emu::block_of_caller().fault() == zen_emu::Fault::warp_prefix_skips_warp0 ? 1 : 0)

template <typename T, typename V>
T atomicAdd(T* address, V value)
{
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old + v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_add(v); });
}

template <typename T, typename V>
T atomicOr(T* address, V value)
{
    static_assert(std::is_integral<T>::value, "atomicOr takes an integer");
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old | v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_or(v); });
}

template <typename T, typename V>
T atomicAnd(T* address, V value)
{
    static_assert(std::is_integral<T>::value, "atomicAnd takes an integer");
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old & v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_and(v); });
}

template <typename T, typename V>
T atomicMax(T* address, V value)
{
    const T v = static_cast<T>(value);
    auto cas_max = [v](std::atomic_ref<T> a) {
        T old = a.load();
        while (old < v && !a.compare_exchange_weak(old, v)) {
        }
        return old;
    };
    return zen_emu::rmw(address, [v](T old) { return std::max(old, v); }, cas_max);
}

template <typename T, typename V>
T atomicExch(T* address, V value)
{
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T) { return v; }, [v](std::atomic_ref<T> a) { return a.exchange(v); });
}

template <typename T, typename U, typename V>
T atomicCAS(T* address, U compare, V value)
{
    T expected = static_cast<T>(compare);
    const T desired = static_cast<T>(value);
    return zen_emu::rmw(
        address, [expected, desired](T old) { return old == expected ? desired : old; },
        [expected, desired](std::atomic_ref<T> a) mutable {
            a.compare_exchange_strong(expected, desired);
            return expected;
        });
}

// ------------------------------------------------------------------ platform of the kernels header

#define ZEN_LAUNCH(grid, block, shmem, stream, ...) \
    ::zen_emu::make_launch(#__VA_ARGS__, (grid), (block), (shmem), &__VA_ARGS__)
#define ZEN_SHARED_ARRAY(type, name) \
    type* name = static_cast<type*>(::zen_emu::block_of_caller().shared())
#define ZEN_DEVICE_GUARD(tensor) (void)(tensor)
#define ZEN_STREAM() 0
#define ZEN_LAUNCH_CHECK() (void)0
#define ZEN_ON_DEVICE(tensor) (tensor).is_cpu()
using ZenStream = int;
