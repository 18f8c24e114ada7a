// The one pybind11 module of csrc/: megatron_zeppelin._router_cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "router.h"

namespace py = pybind11;

PYBIND11_MODULE(_router_cpp, m) {
  m.doc() = "C++ twin of megatron_zeppelin.router.reference (same schedules bit for bit)";
  m.def(
      "route_raw",
      [](zeppelin_router::i64 nodes, zeppelin_router::i64 gpus_per_node,
         zeppelin_router::i64 nics_per_node, const std::vector<zeppelin_router::i64>& gpu_to_nic,
         const std::vector<zeppelin_router::i64>& costs,
         const std::vector<zeppelin_router::i64>& src,
         const std::vector<zeppelin_router::i64>& dst,
         const std::vector<zeppelin_router::i64>& nbytes, zeppelin_router::i64 align,
         zeppelin_router::i64 max_chunks, zeppelin_router::i64 min_chunk_bytes) {
        zeppelin_router::RawResult r;
        {
          py::gil_scoped_release release;
          r = zeppelin_router::route_raw(nodes, gpus_per_node, nics_per_node, gpu_to_nic, costs,
                                         src, dst, nbytes, align, max_chunks,
                                         min_chunk_bytes);
        }
        return py::make_tuple(r.flat, r.nic_out, r.nic_in,
                              py::make_tuple(r.phases[0], r.phases[1], r.phases[2]),
                              r.direct_ticks, r.chunks, r.ticks);
      },
      py::arg("nodes"), py::arg("gpus_per_node"), py::arg("nics_per_node"),
      py::arg("gpu_to_nic"), py::arg("costs"), py::arg("src"), py::arg("dst"), py::arg("nbytes"),
      py::arg("align"), py::arg("max_chunks"), py::arg("min_chunk_bytes"),
      "Route flat, validated flows; same signature and result as reference.route_raw.\n"
      "costs: (NVLink ticks/byte, NVLink ticks/message, NIC ticks/byte, NIC ticks/message);\n"
      "max_chunks / min_chunk_bytes: the pipeline's chunk rule (router/model.py).\n"
      "Returns (flat slices [flow, src_proxy, dst_proxy, offset, nbytes]*, NIC egress bytes,\n"
      "NIC ingress bytes, (dispatch, NIC, combine) ticks, direct ticks, chunks, pipelined\n"
      "step ticks).");
}
