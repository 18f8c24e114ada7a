// The pybind11 module megatron_zeppelin._planner_cpp: the C++ twin of the portfolio's planners.
// Every call copies its inputs, releases the GIL for the whole computation, and returns plain
// plan.py's own objects (AttentionTasks, Segments) and plain Python lists.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "planner.h"

namespace py = pybind11;
using namespace zeppelin_planner;

namespace {

// The problem from planner/native.problem_args (same field order).
Problem make_problem(const py::tuple& t) {
  Problem pb;
  pb.seqlens = t[0].cast<std::vector<i64>>();
  pb.capacity = t[1].cast<i64>();
  pb.nodes = t[2].cast<i64>();
  pb.gpn = t[3].cast<i64>();
  const py::tuple k = t[4].cast<py::tuple>();
  Costs& c = pb.costs;
  c.attn_coef = k[0].cast<double>();
  c.log_lengths = k[1].cast<std::vector<double>>();
  c.flops_per_s = k[2].cast<std::vector<double>>();
  c.kv_per_token = k[3].cast<double>();
  c.bwd_bytes_factor = k[4].cast<double>();
  c.layers = k[5].cast<i64>();
  c.nvlink_byte_per_s = k[6].cast<double>();
  c.nvlink_latency_s = k[7].cast<double>();
  c.nic_byte_per_s = k[8].cast<double>();
  c.nic_latency_s = k[9].cast<double>();
  c.routable = k[10].cast<bool>();
  c.routed_log_sizes = k[11].cast<std::vector<double>>();
  c.routed_log_times = k[12].cast<std::vector<double>>();
  c.linear_per_token = k[13].cast<double>();
  c.ring_step_s = k[14].cast<double>();
  c.remap_step_s = k[15].cast<double>();
  c.window = k[16].cast<double>();
  c.window_share = k[17].cast<double>();
  c.halo_split = k[18].cast<bool>();
  pb.routing = t[5].cast<bool>();
  pb.remap = t[6].cast<bool>();
  pb.slack = t[7].cast<double>();
  pb.linear_r = t[8].cast<double>();
  pb.remap_c = t[9].cast<double>();
  pb.qkvo_bytes = t[10].cast<double>();
  pb.tp = t[11].cast<i64>();
  pb.nics_per_node = t[12].cast<i64>();
  pb.gpu_to_nic = t[13].cast<std::vector<i64>>();
  pb.grad_s = t[14].cast<double>();
  pb.bwd_ratio = t[15].cast<double>();
  pb.fwd_bwd_linear = t[16].cast<double>();
  pb.shared_by = t[17].cast<double>();
  if (pb.seqlens.empty() || pb.nodes < 1 || pb.gpn < 1 || pb.capacity < 1 ||
      c.log_lengths.empty() || c.log_lengths.size() != c.flops_per_s.size() ||
      c.routed_log_sizes.size() != c.routed_log_times.size() ||
      static_cast<i64>(pb.gpu_to_nic.size()) != pb.gpn * pb.tp) {
    throw std::invalid_argument("_planner_cpp: inconsistent problem (build it with "
                                "planner.native.problem_args)");
  }
  pb.order = longest_first(pb.seqlens);
  return pb;
}

// Every tuple returned below holds only ints, the Tier enum's members and such tuples: it can
// be part of no reference cycle, so it leaves the cyclic garbage collector's lists once filled
// (what CPython's collector does itself to such tuples at its next pass, here without that
// pass: 38K documents make ~150K tuples, which otherwise cost the caller's collections ~60 ms).
PyObject* untracked(PyObject* tuple) {
  if (PyObject_GC_IsTracked(tuple)) PyObject_GC_UnTrack(tuple);
  return tuple;
}

// An instance of the tuple subclass ``type`` (a NamedTuple of plan.py) holding ``items``,
// built as ``tuple.__new__(type, items)`` builds it, without a Python-level call.
py::object tuple_of(const py::object& type, std::initializer_list<PyObject*> items) {
  auto* cls = reinterpret_cast<PyTypeObject*>(type.ptr());
  PyObject* out = cls->tp_alloc(cls, static_cast<Py_ssize_t>(items.size()));
  if (out == nullptr) throw py::error_already_set();
  Py_ssize_t i = 0;
  for (PyObject* item : items) PyTuple_SET_ITEM(out, i++, item);  // steals the references
  return py::reinterpret_steal<py::object>(untracked(out));
}

PyObject* int_of(i64 value) { return PyLong_FromLongLong(value); }

// The tasks as a list of plan.AttentionTask (wave 0).
py::list tasks_out(const Tasks& tasks) {
  const py::module_ plan = py::module_::import("megatron_zeppelin.plan");
  const py::object task_type = plan.attr("AttentionTask");
  const py::object tier_type = plan.attr("Tier");
  const py::object tiers[3] = {tier_type(0), tier_type(1), tier_type(2)};
  py::list out(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    py::tuple ring(tasks[i].ring.size());
    for (size_t j = 0; j < tasks[i].ring.size(); ++j) {
      PyTuple_SET_ITEM(ring.ptr(), j, int_of(tasks[i].ring[j]));
    }
    untracked(ring.ptr());
    out[i] = tuple_of(task_type, {int_of(static_cast<i64>(i)), ring.release().ptr(),
                                  tiers[tasks[i].tier].inc_ref().ptr(), int_of(0)});
  }
  return out;
}

// A layout as a tuple per rank of plan.Segment.
py::tuple layout_out(const Layout& layout) {
  const py::object segment = py::module_::import("megatron_zeppelin.plan").attr("Segment");
  py::tuple out(layout.size());
  for (size_t r = 0; r < layout.size(); ++r) {
    py::tuple segs(layout[r].size());
    for (size_t j = 0; j < layout[r].size(); ++j) {
      const Seg& s = layout[r][j];
      PyTuple_SET_ITEM(segs.ptr(), j,
                       tuple_of(segment, {int_of(s.seq), int_of(s.start), int_of(s.end)})
                           .release().ptr());
    }
    PyTuple_SET_ITEM(out.ptr(), r, untracked(segs.release().ptr()));
  }
  untracked(out.ptr());
  return out;
}

// ``items[i]`` of a tuple argument, checked: the pickle of a Plan (``Plan.__reduce__``) holds
// tuples only.
PyObject* item_of(PyObject* tuple, Py_ssize_t i, const char* what) {
  if (!PyTuple_Check(tuple) || i >= PyTuple_GET_SIZE(tuple)) {
    throw std::invalid_argument(std::string("_planner_cpp.plan_parts: malformed ") + what);
  }
  return PyTuple_GET_ITEM(tuple, i);
}

// Segments from (seqs, starts, ends) columns (an empty tuple: none), holding the columns' own
// int objects.
std::vector<py::object> segments_of(const py::tuple& columns, const py::object& segment) {
  std::vector<py::object> out;
  if (columns.empty()) return out;
  PyObject* cols[3] = {item_of(columns.ptr(), 0, "segment columns"),
                       item_of(columns.ptr(), 1, "segment columns"),
                       item_of(columns.ptr(), 2, "segment columns")};
  const Py_ssize_t n = PyTuple_Check(cols[0]) ? PyTuple_GET_SIZE(cols[0]) : 0;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* seq = item_of(cols[0], i, "segment seqs");
    PyObject* start = item_of(cols[1], i, "segment starts");
    PyObject* end = item_of(cols[2], i, "segment ends");
    Py_INCREF(seq);
    Py_INCREF(start);
    Py_INCREF(end);
    out.push_back(tuple_of(segment, {seq, start, end}));
  }
  return out;
}

template <typename F>
auto without_gil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

// A C++ CapacityError becomes planner.common.CapacityError (same message).
template <typename F>
auto guarded(F&& f) {
  try {
    return without_gil(std::forward<F>(f));
  } catch (const CapacityError& e) {
    py::object error =
        py::module_::import("megatron_zeppelin.planner.common").attr("CapacityError");
    PyErr_SetString(error.ptr(), e.message.c_str());
    throw py::error_already_set();
  }
}

}  // namespace

PYBIND11_MODULE(_planner_cpp, m) {
  m.doc() = "C++ twin of megatron_zeppelin.planner (zeppelin's portfolio; same plans bit for bit)";
  m.def("portfolio", [](const py::tuple& problem) {
    const Problem pb = make_problem(problem);
    Choice c = guarded([&] {
      Choice out = zeppelin_planner::portfolio(pb);
      if (!out.remapped) out.linear = attention_layout(pb, out.tasks);
      return out;
    });
    return py::make_tuple(c.names, c.estimates, c.winner, tasks_out(c.tasks),
                          layout_out(c.linear));
  }, "(candidate names, estimated step seconds, winner index, its AttentionTasks, its linear "
     "layout (Segments per rank): the attention layout unless remapped)");
  m.def("whole_segments", [](const std::vector<i64>& lengths) {
    const py::object segment = py::module_::import("megatron_zeppelin.plan").attr("Segment");
    py::tuple out(lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      PyTuple_SET_ITEM(out.ptr(), i, tuple_of(segment, {int_of(static_cast<i64>(i)), int_of(0),
                                                        int_of(lengths[i])}).release().ptr());
    }
    untracked(out.ptr());
    return out;
  }, "(Segment(i, 0, lengths[i]) for every i), as a tuple");
  m.def("plan_parts", [](const py::tuple& rings, const py::tuple& tiers, const py::tuple& waves,
                         const py::tuple& counts, const py::tuple& linear,
                         const py::tuple& sources) {
    const py::module_ plan = py::module_::import("megatron_zeppelin.plan");
    const py::object task_type = plan.attr("AttentionTask");
    const py::object segment = plan.attr("Segment");
    const py::object tier_type = plan.attr("Tier");
    const py::object tier_of[3] = {tier_type(0), tier_type(1), tier_type(2)};
    const Py_ssize_t n = static_cast<Py_ssize_t>(rings.size());
    if (static_cast<Py_ssize_t>(tiers.size()) != n || static_cast<Py_ssize_t>(waves.size()) != n) {
      throw std::invalid_argument("_planner_cpp.plan_parts: rings, tiers and waves differ in "
                                  "length");
    }
    py::tuple tasks(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* ring = item_of(rings.ptr(), i, "rings");
      const long tier = PyLong_AsLong(item_of(tiers.ptr(), i, "tiers"));
      if (tier < 0 || tier > 2) throw std::invalid_argument("_planner_cpp.plan_parts: bad tier");
      PyObject* wave = item_of(waves.ptr(), i, "waves");
      untracked(ring);
      Py_INCREF(ring);
      Py_INCREF(wave);
      PyTuple_SET_ITEM(tasks.ptr(), i,
                       tuple_of(task_type, {PyLong_FromSsize_t(i), ring,
                                            tier_of[tier].inc_ref().ptr(), wave})
                           .release().ptr());
    }
    std::vector<py::object> segs = segments_of(linear, segment);
    py::tuple layout(counts.size());
    size_t first = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      const size_t count = counts[r].cast<size_t>();
      if (first + count > segs.size()) {
        throw std::invalid_argument("_planner_cpp.plan_parts: counts exceed the segments");
      }
      py::tuple rank(count);
      for (size_t j = 0; j < count; ++j) {
        PyTuple_SET_ITEM(rank.ptr(), j, segs[first + j].release().ptr());
      }
      first += count;
      PyTuple_SET_ITEM(layout.ptr(), r, untracked(rank.release().ptr()));
    }
    if (first != segs.size()) {
      throw std::invalid_argument("_planner_cpp.plan_parts: counts do not cover the segments");
    }
    std::vector<py::object> source_segs = segments_of(sources, segment);
    py::tuple source_out(source_segs.size());
    for (size_t i = 0; i < source_segs.size(); ++i) {
      PyTuple_SET_ITEM(source_out.ptr(), i, source_segs[i].release().ptr());
    }
    untracked(tasks.ptr());
    untracked(layout.ptr());
    untracked(source_out.ptr());
    return py::make_tuple(tasks, layout, source_out);
  }, "Plan._rebuild_plan's parts from Plan.__reduce__'s columns: (tasks, linear layout, "
     "sources), every tuple out of the cyclic garbage collector");
  m.def("attention_layout", [](const py::sequence& groups, const std::vector<i64>& seqlens,
                               i64 world) {
    const py::object segment = py::module_::import("megatron_zeppelin.plan").attr("Segment");
    std::vector<std::vector<py::object>> out(static_cast<size_t>(world));
    const auto seg = [&](i64 seq, i64 start, i64 end) {
      return tuple_of(segment, {int_of(seq), int_of(start), int_of(end)});
    };
    for (const py::handle group : groups) {
      const std::vector<i64> ring = group.attr("ring").cast<std::vector<i64>>();
      const std::vector<i64> seqs = group.attr("seqs").cast<std::vector<i64>>();
      for (i64 rank : ring) {
        if (rank < 0 || rank >= world) throw std::invalid_argument("ring rank out of range");
      }
      for (i64 seq : seqs) {
        if (seq < 0 || seq >= static_cast<i64>(seqlens.size())) {
          throw std::invalid_argument("sequence index out of range");
        }
      }
      const i64 size = static_cast<i64>(ring.size());
      if (size == 1) {
        for (i64 seq : seqs) out[ring[0]].push_back(seg(seq, 0, seqlens[seq]));
        continue;
      }
      const i64 n = 2 * size;
      for (i64 pos = 0; pos < size; ++pos) {
        const i64 mirror = n - 1 - pos;
        for (i64 seq : seqs) {
          const i64 length = seqlens[seq];
          out[ring[pos]].push_back(seg(seq, pos * length / n, (pos + 1) * length / n));
          out[ring[pos]].push_back(seg(seq, mirror * length / n, (mirror + 1) * length / n));
        }
      }
    }
    py::tuple layout(world);
    for (size_t r = 0; r < out.size(); ++r) {
      py::tuple rank(out[r].size());
      for (size_t j = 0; j < out[r].size(); ++j) {
        PyTuple_SET_ITEM(rank.ptr(), j, out[r][j].release().ptr());
      }
      PyTuple_SET_ITEM(layout.ptr(), r, untracked(rank.release().ptr()));
    }
    untracked(layout.ptr());
    return layout;
  }, "plan.attention_layout_of(groups, seqlens, world): the same Segments per rank");
  m.def("hierarchical", [](const py::tuple& problem, bool with_linear) {
    const Problem pb = make_problem(problem);
    return tasks_out(guarded([&] { return place_hierarchical(pb, with_linear); }));
  });
  m.def("hybrid_dp", [](const py::tuple& problem, i64 per_rank) {
    const Problem pb = make_problem(problem);
    return tasks_out(guarded([&] { return hybrid_dp_tasks(pb, per_rank); }));
  });
  m.def("static_cp", [](const py::tuple& problem, i64 cp) {
    const Problem pb = make_problem(problem);
    return tasks_out(guarded([&] { return static_cp_tasks(pb, cp); }));
  });
  m.def("static_cp_best", [](const py::tuple& problem, i64 max_cp) {
    const Problem pb = make_problem(problem);
    auto result = guarded([&] { return static_cp_best(pb, max_cp); });
    return py::make_tuple(result.first, tasks_out(result.second));
  });
  m.def("hydraulis", [](const py::tuple& problem) {
    const Problem pb = make_problem(problem);
    auto result = guarded([&] { return hydraulis_tasks(pb); });
    return py::make_tuple(tasks_out(result.first), result.second);
  });
}
