//! `specplan dot`: Graphviz of one bucket's launches and buffers. Every plan string is
//! escaped (`format::escape`: quotes, backslashes and control characters), so no name can
//! end a DOT string or forge a line.

use specplan_format as format;

/// Launch-level dataflow of one bucket: launches as boxes, buffers as ellipses.
pub fn plan_dot(p: &format::Plan, b: &format::BucketPlan) -> String {
    use format::{Access, ArgValue, LaunchKind};
    use std::fmt::Write as _;
    let mut s = format!(
        "digraph \"{} bucket {}\" {{\n  rankdir=TB;\n  node [fontname=monospace];\n",
        format::escape(&p.name),
        b.batch
    );
    for (i, buf) in b.buffers.iter().enumerate() {
        let _ = writeln!(
            s,
            "  b{i} [shape=ellipse, label=\"%{}\\n{:?} @{:#x}\"];",
            format::escape(&buf.name),
            buf.shape,
            buf.offset
        );
    }
    for (li, l) in b.launches.iter().enumerate() {
        let (label, uses): (String, Vec<(u32, Access)>) = match &l.kind {
            LaunchKind::Kernel { kernel, args, .. } => (
                p.kernels
                    .get(*kernel as usize)
                    .map_or("?".into(), |k| k.entry.name().to_string()),
                {
                    let fields = p
                        .kernels
                        .get(*kernel as usize)
                        .map_or(&[][..], |k| k.entry.abi().fields);
                    args.iter()
                        .zip(fields)
                        .filter_map(|(a, f)| match (a, f.kind) {
                            (ArgValue::Buffer(id), specplan_kernels::abi::FieldKind::Ptr(pf)) => Some((*id, pf.access)),
                            _ => None,
                        })
                        .collect()
                },
            ),
            LaunchKind::Gemm(g) => (
                format!("gemm {}x{}x{}", g.m, g.n, g.k),
                [
                    (g.a, Access::Read),
                    (g.c, if g.accumulate { Access::ReadWrite } else { Access::Write }),
                ]
                .into_iter()
                .chain(g.rounded.map(|r| (r, Access::Write)))
                .collect(),
            ),
            LaunchKind::Collective(c) => (
                format!("{} {}", c.op.name(), c.count),
                if c.send == c.recv {
                    vec![(c.send, Access::ReadWrite)]
                } else {
                    vec![(c.send, Access::Read), (c.recv, Access::Write)]
                },
            ),
        };
        let _ = writeln!(
            s,
            "  l{li} [shape=box, label=\"#{li} {}\\n{label}\"];",
            format::escape(&l.op)
        );
        for (id, access) in uses {
            if access.reads() {
                let _ = writeln!(s, "  b{id} -> l{li};");
            }
            if access.writes() {
                let _ = writeln!(s, "  l{li} -> b{id};");
            }
        }
    }
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DOT line is well formed when its quotes pair up (escaped ones aside).
    fn quotes_pair_up(line: &str) -> bool {
        let (mut open, mut escaped) = (false, false);
        for c in line.chars() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => open = !open,
                _ => {}
            }
        }
        !open && !escaped
    }

    #[test]
    fn names_cannot_break_the_graph() {
        let cfg = specplan_compiler::config::resolve(
            &specplan_compiler::config::Source::Preset("tiny".into()),
            &Default::default(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let compiled =
            specplan_compiler::compile(&cfg, &Default::default(), None, &|_, _| {}).unwrap_or_else(|e| panic!("{e}"));
        // Not validated: the printer must hold even for names `validate` would refuse.
        let mut p = compiled.plan.into_inner();
        p.name = "evil\" }\n digraph x { \\".into();
        p.phases[0].buckets[0].buffers[0].name = "buf\"\nforged [label=\"x\"];".into();
        p.phases[0].buckets[0].launches[0].op = "op\r\"}".into();
        let b = &p.buckets()[0];
        let dot = plan_dot(&p, b);
        let lines: Vec<&str> = dot.lines().collect();
        // Every line is one the printer wrote: none came from a name.
        assert!(
            lines[0].starts_with("digraph \"evil\\\" }\\u{a} digraph x { \\\\ bucket "),
            "{}",
            lines[0]
        );
        assert_eq!(lines.last(), Some(&"}"));
        assert!(lines.iter().all(|l| quotes_pair_up(l)), "{dot}");
        assert!(!lines.iter().any(|l| l.starts_with("forged")), "{dot}");
        assert!(dot.contains("%buf\\\"\\u{a}forged [label=\\\"x\\\"];"), "{dot}");
    }
}
