//! Deterministic text and Graphviz printers for the op graph.

use specplan_format::io;
use std::fmt::Write as _;

use super::{OpGraph, OpKind, Storage};

fn kind_args(k: &OpKind) -> String {
    match k {
        OpKind::Linear { bias, accumulate } => format!("(bias={bias}, accumulate={accumulate})"),
        OpKind::Rope { heads, step: 0 } => format!("(heads={heads})"),
        OpKind::Rope { heads, step } => format!("(heads={heads}, step={step})"),
        OpKind::KvAppend { layer, step: 0 } | OpKind::RopeAppend { layer, step: 0 } => format!("(layer={layer})"),
        OpKind::KvAppend { layer, step } | OpKind::RopeAppend { layer, step } => {
            format!("(layer={layer}, step={step})")
        }
        OpKind::Attention {
            layer,
            window,
            step,
            select,
        } => {
            let step = if *step > 0 {
                format!(", step={step}")
            } else {
                String::new()
            };
            let select = if *select { ", select" } else { "" };
            format!(
                "(layer={layer}, window={}{step}{select})",
                window.map_or("none".to_string(), |w| w.to_string())
            )
        }
        OpKind::TreeSelect { step } | OpKind::GatherRows { step } => format!("(step={step})"),
        OpKind::TopK { k, refine } => format!("(k={k}, refine={refine})"),
        OpKind::EmbedConcat { bias } => format!("(bias={bias})"),
        OpKind::SoftmaxTopK { k, map, refine } => {
            format!("(k={k}, map={}, refine={refine})", map.map_or("none", |m| m.name()))
        }
        OpKind::TopKMerge { k, map } => format!("(k={k}, map={})", map.map_or("none", |m| m.name())),
        OpKind::TopKRecords { k } => format!("(k={k})"),
        OpKind::AllGather { ranks } | OpKind::LogitsGather { ranks } => format!("(ranks={ranks})"),
        OpKind::MapIds { map } => format!("({})", map.name()),
        _ => String::new(),
    }
}

/// One line per tensor, then one per op in topological order.
pub fn print_graph(g: &OpGraph) -> String {
    let mut s = String::new();
    let used: std::collections::BTreeSet<u32> = g
        .graph
        .node_weights()
        .flat_map(|op| op.ins.iter().chain(op.outs.iter()).map(|t| t.0))
        .collect();
    for (i, t) in g.tensors.iter().enumerate() {
        if !used.contains(&(i as u32)) {
            continue;
        }
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        let storage = match &t.storage {
            Storage::Input => "input".to_string(),
            Storage::Activation { output: true } => "output".into(),
            Storage::Activation { output: false } => "activation".into(),
            Storage::Weight { sources, .. } => format!("weight <- {}", sources.join(",")),
            Storage::KvCache { layer, kind } => format!("kv_cache layer={layer} {kind:?}"),
            Storage::PageTable => io::PAGE_TABLE.into(),
        };
        let alias = t.alias_of.map_or(String::new(), |a| format!(" (in place over {a})"));
        let _ = writeln!(
            s,
            "t{i} %{} {} [{}] {storage}{alias}",
            t.name,
            t.dtype.name(),
            shape.join(",")
        );
    }
    match g.topo_order() {
        Ok(order) => {
            for n in order {
                let op = &g.graph[n];
                let names = |ts: &[super::TensorId]| {
                    ts.iter()
                        .map(|t| format!("%{}", g.tensor(*t).name))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let _ = writeln!(
                    s,
                    "n{} {} = {}{}({}) -> {}",
                    n.index(),
                    op.name,
                    op.kind.mnemonic(),
                    kind_args(&op.kind),
                    names(&op.ins),
                    names(&op.outs)
                );
            }
        }
        Err(n) => {
            let _ = writeln!(s, "<cycle through n{}>", n.index());
        }
    }
    s
}

fn esc(s: &str) -> String {
    s.replace('"', "\\\"")
}

/// Graphviz: ops as boxes, activations as edges labelled with the tensor name.
pub fn to_dot(g: &OpGraph, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=monospace];",
        esc(title)
    );
    let mut nodes: Vec<_> = g.graph.node_indices().collect();
    nodes.sort_by_key(|n| (g.graph[*n].rank, n.index()));
    for n in &nodes {
        let op = &g.graph[*n];
        let _ = writeln!(
            s,
            "  n{} [label=\"{}\\n{}\"];",
            n.index(),
            esc(&op.name),
            op.kind.mnemonic()
        );
    }
    let producers = g.producers();
    for n in &nodes {
        for &t in &g.graph[*n].ins {
            let tensor = g.tensor(t);
            match producers[t.0 as usize] {
                Some(p) => {
                    let _ = writeln!(
                        s,
                        "  n{} -> n{} [label=\"{}\"];",
                        p.index(),
                        n.index(),
                        esc(&tensor.name)
                    );
                }
                None if matches!(tensor.storage, Storage::Input) => {
                    let _ = writeln!(
                        s,
                        "  \"in:{0}\" [shape=ellipse, label=\"{0}\"];\n  \"in:{0}\" -> n{1};",
                        esc(&tensor.name),
                        n.index()
                    );
                }
                None => {}
            }
        }
    }
    s.push_str("}\n");
    s
}
