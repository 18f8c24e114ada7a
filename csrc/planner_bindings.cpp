// The pybind11 module megatron_zeppelin._planner_cpp: the C++ twin of the portfolio's planners.
// Every call copies its inputs, releases the GIL for the whole computation, and returns plain
// plan.py's own objects (AttentionTasks, Segments) and plain Python lists.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

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

// An instance of the tuple subclass ``type`` (a NamedTuple of plan.py) holding ``items``,
// built as ``tuple.__new__(type, items)`` builds it, without a Python-level call.
py::object tuple_of(const py::object& type, std::initializer_list<PyObject*> items) {
  auto* cls = reinterpret_cast<PyTypeObject*>(type.ptr());
  PyObject* out = cls->tp_alloc(cls, static_cast<Py_ssize_t>(items.size()));
  if (out == nullptr) throw py::error_already_set();
  Py_ssize_t i = 0;
  for (PyObject* item : items) PyTuple_SET_ITEM(out, i++, item);  // steals the references
  return py::reinterpret_steal<py::object>(out);
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
    PyTuple_SET_ITEM(out.ptr(), r, segs.release().ptr());
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
    return out;
  }, "(Segment(i, 0, lengths[i]) for every i), as a tuple");
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
