// Native op observer: a global at::RecordFunction callback that records every torch op (forward,
// backward and user scopes, on every thread) as Kineto would, without the Python round trip a
// TorchDispatchMode costs per op.
//
// Hot path (start/end callbacks, no Python, no lock in the common case): an op's signature (name,
// input shapes, dtypes, scalar values) is hashed and looked up in a per-thread cache of signature
// ids; only a signature never seen before is spelled out in Kineto's JSON ("Input Dims", "Input
// type", "Concrete Inputs"), once. A training loop repeats its signatures every step, so a record
// is a handful of integers: signature id, CLOCK_MONOTONIC start/end (the clock time.perf_counter_ns
// reads on Linux), thread, autograd sequence number, forward thread, external correlation id, and
// whether an exception ended it.
// When a CUPTI push/pop pair was handed in, each op is bracketed with its external correlation id
// so the kernels it launches join to it exactly.
//
// take() hands the finished records to Python as packed column bytes (numpy reads them without a
// copy) and signatures() the signature strings added since a given id; both run off the hot path.
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

struct OpRecord {
  int64_t start_ns;
  int64_t end_ns;
  int64_t tid;
  int64_t sequence_nr;
  int64_t fwd_thread_id;
  int64_t external_id;
  uint32_t signature;
  uint8_t scope;
  uint8_t raised;  // 1: the op ended by an exception propagating through it (it did not complete)
};

struct Signature {
  std::string name, dims, types, concrete;
};

// Signature ids carry this bit in the per-thread caches when the op is one that never launches
// device work (set_unbracketed): it gets no external correlation id, so anything launched inside it
// joins to the enclosing op, which is the one whose span exists.
constexpr uint32_t kUnbracketed = 0x80000000u;

struct Context : at::ObserverContext {
  OpRecord rec;
  bool bracketed = false;  // an external correlation id was pushed for it
  bool async = false;      // started and ended by different threads (a gloo collective's work)
  uint64_t generation = 0;  // g_generation when it began
  int uncaught = 0;        // std::uncaught_exceptions() when the op began
};

// Async ops (RecordFunction::isAsync: a collective's work, begun on a process group's thread) begun since
// the last start() and not yet ended. Gloo completes a collective's future, which wakes the training thread,
// before its thread ends the op: the step could end, and the observer stop, first, and the op was never
// recorded (a full DDP step without its gloo:all_reduce, about one rank-step in five on 2 CPU ranks). The
// session waits, briefly, for these to end before it stops the observer at a full step's end.
// Counted per start(): one an earlier stop() left open ends uncounted, never below this step's count.
std::atomic<int64_t> g_async_open{0};
std::atomic<uint64_t> g_generation{0};

// Finished records of one thread; take() swaps every buffer out under its own (uncontended) lock.
struct ThreadBuffer {
  std::mutex mutex;
  std::vector<OpRecord> records;
};

// CUptiResult (*)(CUpti_ExternalCorrelationKind, uint64_t) and its pop twin, resolved in Python.
using PushFn = int (*)(int, uint64_t);
using PopFn = int (*)(int, uint64_t*);
constexpr int kExternalKindCustom0 = 3;
// A run whose shapes keep changing (a decode loop's growing KV cache) would grow the signature table
// without end: past this many, new signatures are recorded by name alone, and counted.
constexpr size_t kMaxSignatures = 1 << 18;

std::mutex g_mutex;  // guards the buffer registry, the signature table and g_first_error
std::vector<std::shared_ptr<ThreadBuffer>> g_buffers;
std::vector<Signature> g_signatures;
std::unordered_map<uint64_t, uint32_t> g_signature_ids;
std::string g_first_error;
std::unordered_set<std::string> g_unbracketed_names;

at::CallbackHandle g_handle = 0;
std::atomic<uint64_t> g_next_id{1};
std::atomic<PushFn> g_push{nullptr};
std::atomic<PopFn> g_pop{nullptr};
std::atomic<uint64_t> g_errors{0};
std::atomic<uint64_t> g_unspelled{0};  // records that got a name-only signature (table full)
// Set in a forked child (a DataLoader worker): nothing there ever takes the records, so it records none.
std::atomic<bool> g_forked_child{false};
// Records between two take()s are bounded (0 = no bound): a step of a million tiny ops (a Python loop)
// would hold them all, and the stitch of them a gigabyte. Past the bound an op is counted, not recorded.
std::atomic<uint64_t> g_limit{0};
std::atomic<uint64_t> g_started{0};
std::atomic<uint64_t> g_over{0};

// fork() copies the locks in whatever state other threads hold them: a child born while another thread
// spelled a signature under g_mutex would block forever at its first new op. The forking thread takes
// every lock first (g_mutex, then each buffer's: the order take() and the callbacks never invert) and
// releases them on both sides.
//
// torch's own callback registry has the same hazard, and its lock is not ours to take: a thread whose
// view of the registry is older than the registry's version takes that lock at its next op to catch up.
// So the forking thread catches up here, under g_mutex, which start() and stop() also hold while they
// change the registry: the child is born current and never needs the lock, whoever held it at the fork.
void catch_up_with_torch_callbacks() { (void)at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION); }

void before_fork() {
  g_mutex.lock();
  catch_up_with_torch_callbacks();
  for (auto& b : g_buffers) b->mutex.lock();
}

void after_fork_parent() {
  for (auto& b : g_buffers) b->mutex.unlock();
  g_mutex.unlock();
}

void after_fork_child() {
  g_forked_child.store(true);
  for (auto& b : g_buffers) {
    std::vector<OpRecord>().swap(b->records);  // the parent's records are the parent's to export
    b->mutex.unlock();
  }
  g_mutex.unlock();
}

void note_error(const char* what) {
  if (g_errors.fetch_add(1, std::memory_order_relaxed) == 0) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_first_error = what;
  }
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct ThreadState {
  int64_t tid = static_cast<int64_t>(syscall(SYS_gettid));
  std::shared_ptr<ThreadBuffer> buffer;
  std::unordered_map<uint64_t, uint32_t> signature_ids;  // this thread's cache of g_signature_ids
  ThreadState() : buffer(std::make_shared<ThreadBuffer>()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_buffers.push_back(buffer);
  }
};

inline ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// ---- signature hashing (hot path): 64-bit FNV-1a over the facts the JSON spells out

struct Hasher {
  uint64_t h = 1469598103934665603ULL;
  inline void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  inline void add(const char* s) {
    for (; *s; ++s) {
      h ^= static_cast<unsigned char>(*s);
      h *= 1099511628211ULL;
    }
    add(0xffULL);
  }
};

// A tensor whose ops Python handles: a FakeTensor while torch.compile traces (its sizes may be symbolic,
// and reading them threw from inside PyTorch's argument parser), a FunctionalTensor, a DTensor. The op on
// it is no work of its own: the real ops it runs (a DTensor's on its local shard) are recorded, and a fake
// one runs none.
bool dispatched_to_python(const at::Tensor& t) {
  return t.defined() && (t.unsafeGetTensorImpl()->is_python_dispatch() ||
                         t.unsafeGetTensorImpl()->has_symbolic_sizes_strides());
}

// False when an input is dispatched_to_python: the op is not recorded.
bool hash_input(const c10::IValue& v, Hasher& h) {
  h.add(static_cast<uint64_t>(v.tag));
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      h.add(0xdeadULL);
      return true;
    }
    if (dispatched_to_python(t)) return false;
    h.add(static_cast<uint64_t>(t.scalar_type()));
    h.add(static_cast<uint64_t>(t.dim()));
    for (int64_t s : t.sizes()) h.add(static_cast<uint64_t>(s));
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) {
      if (dispatched_to_python(t)) return false;
      h.add(t.defined() ? static_cast<uint64_t>(t.dim()) : 0xdeadULL);
      if (t.defined()) for (int64_t s : t.sizes()) h.add(static_cast<uint64_t>(s));
    }
  } else if (v.isInt()) {
    h.add(static_cast<uint64_t>(v.toInt()));
  } else if (v.isBool()) {
    h.add(v.toBool() ? 1 : 0);
  } else if (v.isIntList()) {
    for (int64_t x : v.toIntList().vec()) h.add(static_cast<uint64_t>(x));
  } else if (v.isBoolList()) {
    // convolution_backward's output_mask: two calls that differ only here cost differently.
    for (bool x : v.toBoolList().vec()) h.add(x ? 1 : 2);
  } else if (v.isString()) {
    h.add(v.toStringRef().c_str());
  }
  return true;
}

// ---- signature spelling (once per new signature)

void append_int(std::string& s, int64_t v) { s.append(std::to_string(v)); }

void append_shape(std::string& s, c10::IntArrayRef sizes) {
  s.push_back('[');
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s.push_back(',');
    append_int(s, sizes[i]);
  }
  s.push_back(']');
}

void append_json_string(std::string& s, const std::string& v) {
  s.push_back('"');
  for (char c : v) {
    if (c == '"' || c == '\\') {
      s.push_back('\\');
      s.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      s.append(buf);
    } else {
      s.push_back(c);
    }
  }
  s.push_back('"');
}

// One scalar as Python's str() spells it, which is what metrics.flops parses back. Floating-point
// scalars stay unrecorded (""): optimizers pass step-dependent ones (AdamW's -lr/bias_correction),
// which would make every step's signatures new, and no cost model reads them.
std::string scalar_text(const c10::IValue& v) {
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return std::to_string(v.toInt());
  return "";
}

// Lists as Kineto's "Concrete Inputs" spell them: "[1, 2]", "[True, False, True]".
template <typename T, typename F>
std::string list_text(const std::vector<T>& xs, F spell_one) {
  std::string out = "[";
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i) out.append(", ");
    out.append(spell_one(xs[i]));
  }
  out.push_back(']');
  return out;
}

void spell_input(const c10::IValue& v, Signature& sig) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) {
      append_shape(sig.dims, t.sizes());
      sig.types.push_back('"');
      sig.types.append(std::string(t.dtype().name()));
      sig.types.push_back('"');
    } else {
      sig.dims.append("[]");
      sig.types.append("\"\"");
    }
    sig.concrete.append("\"\"");
    return;
  }
  if (v.isTensorList()) {
    sig.dims.push_back('[');
    bool first = true;
    for (const at::Tensor& t : v.toTensorList().vec()) {
      if (!first) sig.dims.push_back(',');
      first = false;
      if (t.defined()) append_shape(sig.dims, t.sizes()); else sig.dims.append("[]");
    }
    sig.dims.push_back(']');
    sig.types.append("\"TensorList\"");
    sig.concrete.append("\"\"");
    return;
  }
  const char* type = "";  // None, devices, generic lists: an empty type, as Kineto leaves them
  std::string conc;
  if (v.isBool() || v.isInt() || v.isDouble()) {
    type = "Scalar";
    conc = scalar_text(v);
  } else if (v.isIntList()) {
    type = "ScalarList";
    conc = list_text(v.toIntList().vec(), [](int64_t x) { return std::to_string(x); });
  } else if (v.isBoolList()) {
    type = "ScalarList";
    conc = list_text(v.toBoolList().vec(), [](bool x) { return std::string(x ? "True" : "False"); });
  } else if (v.isDoubleList()) {
    type = "ScalarList";  // left unrecorded like float scalars: step-dependent in optimizers
  } else if (v.isString()) {
    type = "String";
    conc = v.toStringRef();
  }
  sig.dims.append("[]");
  sig.types.push_back('"');
  sig.types.append(type);
  sig.types.push_back('"');
  append_json_string(sig.concrete, conc);
}

Signature spell(const at::RecordFunction& fn, bool with_inputs) {
  Signature sig;
  sig.name = fn.name();
  sig.dims = "[";
  sig.types = "[";
  sig.concrete = "[";
  if (with_inputs) {
    bool first = true;
    for (const c10::IValue& v : fn.inputs()) {
      if (!first) {
        sig.dims.push_back(',');
        sig.types.push_back(',');
        sig.concrete.push_back(',');
      }
      first = false;
      spell_input(v, sig);
    }
  }
  sig.dims.push_back(']');
  sig.types.push_back(']');
  sig.concrete.push_back(']');
  return sig;
}

constexpr uint32_t kNotRecorded = 0xFFFFFFFFu;  // an op on a tensor dispatched_to_python

// Returns the signature id, with kUnbracketed set for ops named in set_unbracketed, or kNotRecorded.
uint32_t signature_id(const at::RecordFunction& fn, ThreadState& ts, bool table_full = false) {
  const bool with_inputs = !table_full && fn.needsInputs();
  Hasher h;
  h.add(fn.name());
  h.add(with_inputs ? 1 : 0);
  if (with_inputs) {
    for (const c10::IValue& v : fn.inputs())
      if (!hash_input(v, h)) return kNotRecorded;
  } else if (table_full && fn.needsInputs()) {
    Hasher ignored;
    for (const c10::IValue& v : fn.inputs())
      if (!hash_input(v, ignored)) return kNotRecorded;
  }
  auto hit = ts.signature_ids.find(h.h);
  if (hit != ts.signature_ids.end()) return hit->second;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto known = g_signature_ids.find(h.h);
    if (known != g_signature_ids.end()) {
      ts.signature_ids.emplace(h.h, known->second);
      return known->second;
    }
    if (with_inputs && g_signatures.size() >= kMaxSignatures) table_full = true;
  }
  if (table_full && with_inputs) {
    g_unspelled.fetch_add(1, std::memory_order_relaxed);
    return signature_id(fn, ts, true);
  }
  Signature sig = spell(fn, with_inputs);
  std::lock_guard<std::mutex> lock(g_mutex);
  uint32_t id = static_cast<uint32_t>(g_signatures.size());
  if (g_unbracketed_names.count(sig.name)) id |= kUnbracketed;
  auto [it, inserted] = g_signature_ids.emplace(h.h, id);
  if (inserted) g_signatures.push_back(std::move(sig));
  ts.signature_ids.emplace(h.h, it->second);
  return it->second;
}

// ---- callbacks

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (g_forked_child.load(std::memory_order_relaxed)) return nullptr;
  const uint64_t limit = g_limit.load(std::memory_order_relaxed);
  if (limit != 0 && g_started.fetch_add(1, std::memory_order_relaxed) >= limit) {
    g_over.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  try {
    ThreadState& ts = thread_state();
    const uint32_t sig = signature_id(fn, ts);
    if (sig == kNotRecorded) return nullptr;
    auto ctx = std::make_unique<Context>();
    OpRecord& r = ctx->rec;
    r.signature = sig & ~kUnbracketed;
    r.tid = ts.tid;
    r.sequence_nr = fn.seqNr();
    r.fwd_thread_id = static_cast<int64_t>(fn.forwardThreadId());
    r.scope = static_cast<uint8_t>(fn.scope());
    r.external_id = static_cast<int64_t>(g_next_id.fetch_add(1, std::memory_order_relaxed));
    ctx->bracketed = false;
    PushFn push = g_push.load(std::memory_order_relaxed);
    if (push != nullptr && !(sig & kUnbracketed)) {
      push(kExternalKindCustom0, static_cast<uint64_t>(r.external_id));
      ctx->bracketed = true;
    }
    r.raised = 0;
    ctx->uncaught = std::uncaught_exceptions();
    if (fn.isAsync()) {
      ctx->async = true;
      ctx->generation = g_generation.load(std::memory_order_relaxed);
      g_async_open.fetch_add(1, std::memory_order_relaxed);
    }
    r.start_ns = now_ns();
    return ctx;
  } catch (const std::exception& err) {
    note_error(err.what());
  } catch (...) {
    note_error("unknown exception");
  }
  return nullptr;
}

void on_end(const at::RecordFunction& /*fn*/, at::ObserverContext* base) {
  if (base == nullptr) return;
  const int64_t end = now_ns();
  try {
    auto* ctx = static_cast<Context*>(base);
    if (ctx->async && ctx->generation == g_generation.load(std::memory_order_relaxed))
      g_async_open.fetch_sub(1, std::memory_order_relaxed);
    PopFn pop = g_pop.load(std::memory_order_relaxed);
    if (ctx->bracketed && pop != nullptr) {
      uint64_t ignored = 0;
      pop(kExternalKindCustom0, &ignored);
    }
    ctx->rec.end_ns = end;
    // RecordFunction ends an op in its guard's destructor, so an op that an exception cut off (a C++ one,
    // or a Python one raised inside it, e.g. from a saved-tensor hook: non-reentrant checkpoint's early
    // stop) ends here during the unwinding, with one more exception in flight on this thread than when it
    // began. Compared with the count at its start, not with zero: an op run whole by a destructor during
    // some other unwinding still completed.
    ctx->rec.raised = std::uncaught_exceptions() > ctx->uncaught ? 1 : 0;
    // The thread that ends an op files it (an async op may end elsewhere than it started).
    ThreadBuffer& buf = *thread_state().buffer;
    std::lock_guard<std::mutex> lock(buf.mutex);
    buf.records.push_back(ctx->rec);
  } catch (const std::exception& err) {
    note_error(err.what());
  } catch (...) {
    note_error("unknown exception");
  }
}

// ---- Python API

// Neither runs in a forked child: there torch's registry lock may be held by a thread that no longer
// exists, and the child records nothing anyway.
void start() {
  if (g_forked_child.load()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_handle != 0) return;
  auto cb = at::RecordFunctionCallback(on_start, on_end)
                .needsInputs(true)
                .needsIds(true)
                .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                         at::RecordScope::USER_SCOPE});
  g_generation.fetch_add(1);
  g_async_open.store(0);
  g_handle = at::addGlobalCallback(cb);
  catch_up_with_torch_callbacks();
}

void stop() {
  if (g_forked_child.load()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_handle == 0) return;
  at::removeCallback(g_handle);
  g_handle = 0;
  catch_up_with_torch_callbacks();
}

void set_correlation(uintptr_t push, uintptr_t pop) {
  // An op pops only what it pushed; set pop before push so a push never lacks its pop. Clearing
  // clears push only: an op bracketed before still pops through the old pop pointer, which the
  // caller keeps valid (libcupti stays loaded; the session clears only between steps).
  if (push == 0 || pop == 0) {
    g_push.store(nullptr);
    return;
  }
  g_pop.store(reinterpret_cast<PopFn>(pop));
  g_push.store(reinterpret_cast<PushFn>(push));
}

void set_unbracketed(const std::vector<std::string>& names) {
  // Applies to signatures first seen after the call: native.load() makes it before any recording.
  std::lock_guard<std::mutex> lock(g_mutex);
  g_unbracketed_names = std::unordered_set<std::string>(names.begin(), names.end());
}

template <typename T, typename F>
py::bytes column(const std::vector<OpRecord>& recs, F get) {
  std::string out(recs.size() * sizeof(T), '\0');
  T* p = reinterpret_cast<T*>(out.data());
  for (size_t i = 0; i < recs.size(); ++i) p[i] = get(recs[i]);
  return py::bytes(out);
}

py::dict take() {
  std::vector<OpRecord> recs;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    buffers = g_buffers;
  }
  for (auto& b : buffers) {
    std::lock_guard<std::mutex> lock(b->mutex);
    recs.insert(recs.end(), b->records.begin(), b->records.end());
    b->records.clear();
  }
  g_started.store(0, std::memory_order_relaxed);
  py::dict out;
  out["over_limit"] = g_over.exchange(0);
  out["start_ns"] = column<int64_t>(recs, [](const OpRecord& r) { return r.start_ns; });
  out["end_ns"] = column<int64_t>(recs, [](const OpRecord& r) { return r.end_ns; });
  out["tid"] = column<int64_t>(recs, [](const OpRecord& r) { return r.tid; });
  out["sequence_number"] = column<int64_t>(recs, [](const OpRecord& r) { return r.sequence_nr; });
  out["fwd_thread_id"] = column<int64_t>(recs, [](const OpRecord& r) { return r.fwd_thread_id; });
  out["external_id"] = column<int64_t>(recs, [](const OpRecord& r) { return r.external_id; });
  out["signature"] = column<uint32_t>(recs, [](const OpRecord& r) { return r.signature; });
  out["scope"] = column<uint8_t>(recs, [](const OpRecord& r) { return r.scope; });
  out["raised"] = column<uint8_t>(recs, [](const OpRecord& r) { return r.raised; });
  return out;
}

py::list signatures(size_t from) {
  std::lock_guard<std::mutex> lock(g_mutex);
  py::list out;
  for (size_t i = from; i < g_signatures.size(); ++i) {
    const Signature& s = g_signatures[i];
    out.append(py::make_tuple(s.name, s.dims, s.types, s.concrete));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_plasmient_op_observer, m) {
  m.doc() = "plasmient-trace native op observer (a global at::RecordFunction callback)";
  pthread_atfork(before_fork, after_fork_parent, after_fork_child);
  m.def("forked_child", []() { return g_forked_child.load(); });
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("take", &take);
  m.def("signatures", &signatures, py::arg("start") = 0);
  m.def("errors", []() { return g_errors.load(); });
  m.def("unspelled", []() { return g_unspelled.load(); });
  m.def("async_open", []() { return std::max<int64_t>(g_async_open.load(), 0); });
  m.attr("MAX_SIGNATURES") = kMaxSignatures;
  m.def("first_error", []() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_first_error;
  });
  m.def("set_correlation", &set_correlation, py::arg("push"), py::arg("pop"));
  m.def("set_limit", [](uint64_t v) { g_limit.store(v); }, py::arg("records"));
  m.def("set_unbracketed", &set_unbracketed, py::arg("names"));
  m.def("next_id", []() { return g_next_id.load(); });
  m.def("set_next_id", [](uint64_t v) { g_next_id.store(v); }, py::arg("value"));
  m.attr("SCOPE_USER") = static_cast<int>(at::RecordScope::USER_SCOPE);
}
