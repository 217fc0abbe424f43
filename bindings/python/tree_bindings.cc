// _core.PrefixTree: the frozen prefix tree of a batch (core/tree/prefix_tree.h) with its
// statistics (tree_stats.h). Node and rollout arguments are bounds-checked here (IndexError), since
// the C++ accessors trust their callers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bindings/python/bindings.h"
#include "core/partition/partition.h"
#include "core/tree/prefix_tree.h"
#include "core/tree/tree_stats.h"

namespace py = pybind11;

namespace dta::python {
namespace {

NodeId CheckedNode(const PrefixTree& tree, NodeId node) {
  if (node < 0 || node >= tree.num_nodes()) {
    throw py::index_error("node " + std::to_string(node) + " is outside [0, " +
                          std::to_string(tree.num_nodes()) + ")");
  }
  return node;
}

RolloutIndex CheckedRollout(const PrefixTree& tree, RolloutIndex r) {
  if (r < 0 || r >= tree.num_rollouts()) {
    throw py::index_error("rollout " + std::to_string(r) + " is outside [0, " +
                          std::to_string(tree.num_rollouts()) + ")");
  }
  return r;
}

template <typename T>
std::vector<T> ToVector(absl::Span<const T> span) {
  return std::vector<T>(span.begin(), span.end());
}

py::dict StatsDict(const PrefixTree& tree) {
  const TreeStats s = ComputeTreeStats(tree);
  py::dict d;
  d["num_rollouts"] = s.num_rollouts;
  d["num_nodes"] = s.num_nodes;
  d["num_leaves"] = s.num_leaves;
  d["num_prefix_rollouts"] = s.num_prefix_rollouts;
  d["num_duplicate_rollouts"] = s.num_duplicate_rollouts;
  d["rollout_tokens"] = s.rollout_tokens;
  d["tree_tokens"] = s.tree_tokens;
  d["leaf_tokens"] = s.leaf_tokens;
  d["longest_rollout"] = s.longest_rollout;
  d["max_children"] = s.max_children;
  d["max_level"] = s.max_level;
  d["compression"] = s.compression;
  d["prefix_sharing"] = s.prefix_sharing;
  d["leaf_compression"] = s.leaf_compression;
  d["potential_overlap_ratio"] = s.potential_overlap_ratio;
  d["dense_attention_work"] = s.dense_attention_work;
  d["tree_attention_work"] = s.tree_attention_work;
  d["attention_compression"] = s.attention_compression;
  return d;
}

// PartitionDfsContiguous's split into `groups` ranks under a BalanceCost, as a dict of plain
// values.
py::dict PartitionDict(const PrefixTree& tree, int groups, int64_t per_token, int64_t per_key) {
  const absl::StatusOr<Partition> p =
      PartitionDfsContiguous(tree, groups, {.per_token = per_token, .per_key = per_key});
  if (!p.ok()) throw py::value_error(std::string(p.status().message()));
  py::dict d;
  d["groups"] = p->groups;
  d["cost"] = p->cost;
  d["tree_tokens"] = p->tree_tokens;
  d["max_cost"] = p->max_cost;
  d["extra_tokens"] = p->extra_tokens;
  d["imbalance"] = p->imbalance;
  return d;
}

}  // namespace

void RegisterTree(py::module_& m) {
  py::class_<PrefixTree>(m, "PrefixTree")
      .def(py::init([](const std::vector<std::vector<TokenId>>& rollouts) {
             absl::StatusOr<PrefixTree> tree = PrefixTree::FromRollouts(rollouts);
             if (!tree.ok()) throw py::value_error(std::string(tree.status().message()));
             return std::move(*tree);
           }),
           py::arg("rollouts"), py::call_guard<py::gil_scoped_release>())
      .def("stats", &StatsDict)
      .def_property_readonly("num_nodes", &PrefixTree::num_nodes)
      .def_property_readonly("num_rollouts", &PrefixTree::num_rollouts)
      .def_property_readonly("num_tree_tokens", &PrefixTree::num_tree_tokens)
      .def_property_readonly("num_rollout_tokens", &PrefixTree::num_rollout_tokens)
      .def("parent", [](const PrefixTree& t, NodeId v) { return t.parent(CheckedNode(t, v)); })
      .def("depth", [](const PrefixTree& t, NodeId v) { return t.depth(CheckedNode(t, v)); })
      .def("length", [](const PrefixTree& t, NodeId v) { return t.length(CheckedNode(t, v)); })
      .def("level", [](const PrefixTree& t, NodeId v) { return t.level(CheckedNode(t, v)); })
      .def("segment",
           [](const PrefixTree& t, NodeId v) { return ToVector(t.segment(CheckedNode(t, v))); })
      .def("children",
           [](const PrefixTree& t, NodeId v) { return ToVector(t.children(CheckedNode(t, v))); })
      .def("is_leaf", [](const PrefixTree& t, NodeId v) { return t.is_leaf(CheckedNode(t, v)); })
      .def("subtree_end",
           [](const PrefixTree& t, NodeId v) { return t.subtree_end(CheckedNode(t, v)); })
      .def("num_rollouts_through",
           [](const PrefixTree& t, NodeId v) { return t.num_rollouts_through(CheckedNode(t, v)); })
      .def("rollouts_ending_at",
           [](const PrefixTree& t, NodeId v) {
             return ToVector(t.rollouts_ending_at(CheckedNode(t, v)));
           })
      .def("end_node",
           [](const PrefixTree& t, RolloutIndex r) { return t.end_node(CheckedRollout(t, r)); })
      .def("rollout_tokens", [](const PrefixTree& t,
                                RolloutIndex r) { return t.RolloutTokens(CheckedRollout(t, r)); })
      .def("lcp", [](const PrefixTree& t, RolloutIndex a,
                     RolloutIndex b) { return t.Lcp(CheckedRollout(t, a), CheckedRollout(t, b)); })
      .def("serialized_tokens", [](const PrefixTree& t) { return ToVector(t.serialized_tokens()); })
      .def("partition", &PartitionDict, py::arg("groups"), py::arg("per_token"),
           py::arg("per_key"));
}

}  // namespace dta::python
