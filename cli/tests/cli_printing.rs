//! Plan strings in `show`, `diff` and `dot` (issue 14, class 7): a name with quotes,
//! backslashes or braces is printed escaped, on its own line, and cannot break a DOT
//! string; a name with a newline never reaches a printer (the plan is refused).

mod common;

use common::*;
use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_format::{encode, Plan};

fn tiny() -> Plan {
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("config");
    specplan_compiler::compile(&cfg, &Default::default(), None, &|_, _| {})
        .expect("compile")
        .plan
        .into_inner()
}

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
fn plan_strings_are_escaped_in_show_diff_and_dot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plain = tiny();
    let mut odd = plain.clone();
    odd.name = r#"ti"ny\ } digraph {"#.into();
    let buf = odd.phases[0].buckets[0]
        .buffers
        .iter_mut()
        .find(|b| b.name == "fc_in")
        .expect("tiny has an fc_in buffer");
    buf.name = r#"ids"];  evil -> x; b0 [label=""#.into();
    odd.phases[0].buckets[0].launches[0].op = r#"op"} evil"#.into();
    let (a, b) = (dir.path().join("a.plan"), dir.path().join("b.plan"));
    std::fs::write(&a, encode(&plain).expect("encode")).expect("write");
    std::fs::write(&b, encode(&odd).expect("encode")).expect("write");

    let show_a = specplan(&["show", &s(&a)]);
    let show_b = specplan(&["show", &s(&b)]);
    assert!(show_b.status.success(), "{}", text(&show_b));
    let (ta, tb) = (
        String::from_utf8_lossy(&show_a.stdout),
        String::from_utf8_lossy(&show_b.stdout),
    );
    assert_eq!(ta.lines().count(), tb.lines().count(), "a name added or removed a line");
    assert!(tb.contains(r#"plan name=ti\"ny\\ } digraph {"#), "{tb}");

    let d = specplan(&["diff", &s(&a), &s(&b)]);
    assert_eq!(d.status.code(), Some(1), "{}", text(&d));
    let dt = String::from_utf8_lossy(&d.stdout);
    let changed: Vec<&str> = dt.lines().filter(|l| l.starts_with("~ ")).collect();
    assert!(changed.iter().any(|l| l.contains(r#"ti\"ny\\ } digraph {"#)), "{dt}");
    assert!(
        changed
            .iter()
            .any(|l| l.contains(r#"ids\"];  evil -> x; b0 [label=\""#)),
        "{dt}"
    );

    let dot = specplan(&["dot", &s(&b)]);
    assert!(dot.status.success(), "{}", text(&dot));
    let g = String::from_utf8_lossy(&dot.stdout);
    assert!(g.starts_with(r#"digraph "ti\"ny\\ } digraph { bucket 1" {"#), "{g}");
    assert!(g.lines().all(quotes_pair_up), "{g}");
    assert!(!g.lines().any(|l| l.trim_start().starts_with("evil")), "{g}");
    let plain_dot = specplan(&["dot", &s(&a)]);
    assert_eq!(
        String::from_utf8_lossy(&plain_dot.stdout).lines().count(),
        g.lines().count()
    );
}

#[test]
fn a_name_with_a_newline_is_refused_before_printing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut p = tiny();
    p.name = "tiny\nbucket 1 forged".into();
    let path = dir.path().join("p.plan");
    std::fs::write(&path, encode(&p).expect("encode")).expect("write");
    for cmd in ["show", "dot"] {
        let o = specplan(&[cmd, &s(&path)]);
        assert_refused(&o, "name: must be 1–256 printable characters");
        assert!(o.stdout.is_empty(), "{cmd} printed from a refused plan");
        assert!(!text(&o).contains("forged"), "{}", text(&o));
    }
}
