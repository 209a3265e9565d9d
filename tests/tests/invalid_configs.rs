//! The invalid-config corpus: every file must be rejected, and the message (which names
//! the field, the value and the rule) is snapshotted.

use specplan_compiler::config::{resolve, Overrides, Source};

#[test]
fn invalid_configs_are_rejected_with_their_field() {
    insta::glob!("../corpus/invalid", "*.toml", |path| {
        let text = std::fs::read_to_string(path).expect("read corpus file");
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        match resolve(&Source::Toml { name, text }, &Overrides::default()) {
            Ok(cfg) => panic!("{} was accepted: {cfg:?}", path.display()),
            Err(e) => insta::assert_snapshot!(e.to_string()),
        }
    });
}

#[test]
fn invalid_flags_are_rejected_with_the_flag_name() {
    let cases: Vec<(&str, Overrides)> = vec![
        (
            "topk-zero",
            Overrides {
                topk: Some(0),
                ..Default::default()
            },
        ),
        (
            "topk1-draft",
            Overrides {
                topk: Some(1),
                num_steps: Some(3),
                num_draft_tokens: Some(3),
                ..Default::default()
            },
        ),
        (
            "draft-too-small",
            Overrides {
                num_draft_tokens: Some(1),
                ..Default::default()
            },
        ),
        (
            "page-size",
            Overrides {
                page_size: Some(6),
                ..Default::default()
            },
        ),
        (
            "buckets-text",
            Overrides {
                buckets: Some("1,two".into()),
                ..Default::default()
            },
        ),
        (
            "sliding-window-zero",
            Overrides {
                sliding_window: Some(0),
                ..Default::default()
            },
        ),
        (
            "hot-vocab-below-topk",
            Overrides {
                hot_vocab_size: Some(2),
                ..Default::default()
            },
        ),
        (
            "dtype",
            Overrides {
                dtype: Some("f32".into()),
                ..Default::default()
            },
        ),
        (
            "max-bs",
            Overrides {
                max_bs: Some(0),
                buckets: Some("auto".into()),
                ..Default::default()
            },
        ),
        // Bucket lists are taken as given or refused: never sorted, deduplicated or cut.
        (
            "buckets-unsorted",
            Overrides {
                buckets: Some("8,4,2".into()),
                ..Default::default()
            },
        ),
        (
            "buckets-repeated",
            Overrides {
                buckets: Some("1,4,4,8".into()),
                ..Default::default()
            },
        ),
        (
            "buckets-zero",
            Overrides {
                buckets: Some("0,2".into()),
                ..Default::default()
            },
        ),
        (
            "buckets-empty-entry",
            Overrides {
                buckets: Some("1,,2".into()),
                ..Default::default()
            },
        ),
        (
            "max-bs-below-buckets",
            Overrides {
                buckets: Some("1,2,4,8".into()),
                max_bs: Some(4),
                ..Default::default()
            },
        ),
        (
            "sliding-window-past-bound",
            Overrides {
                sliding_window: Some(u32::MAX),
                ..Default::default()
            },
        ),
        (
            "context-past-positions",
            Overrides {
                max_context_len: Some(1 << 23),
                ..Default::default()
            },
        ),
        (
            "pool-past-bound",
            Overrides {
                kv_pool_pages: Some(u32::MAX),
                ..Default::default()
            },
        ),
    ];
    let mut out = String::new();
    for (name, o) in cases {
        let e = resolve(&Source::Preset("tiny".into()), &o).expect_err(name);
        out.push_str(&format!("## {name}\n{e}\n"));
    }
    let e = resolve(&Source::Preset("nope".into()), &Overrides::default()).expect_err("unknown preset");
    out.push_str(&format!("## unknown-preset\n{e}\n"));
    let e = resolve(
        &Source::HfConfig {
            name: "x".into(),
            text: "{\"hidden_size\": 8".into(),
        },
        &Overrides::default(),
    )
    .expect_err("bad json");
    out.push_str(&format!("## hf-not-json\n{e}\n"));
    let e = resolve(
        &Source::HfConfig {
            name: "x".into(),
            text: "{\"hidden_size\": 64}".into(),
        },
        &Overrides::default(),
    )
    .expect_err("hf missing keys");
    out.push_str(&format!("## hf-missing-keys-and-flags\n{e}\n"));
    // JSON has no NaN or infinity; a Python writer puts them there anyway.
    for (name, text) in [
        ("hf-nan", "{\"hidden_size\": 64,\n \"rope_theta\": NaN}"),
        ("hf-infinity", "{\"rope_theta\": -Infinity}"),
        ("hf-number-overflow", "{\"rope_theta\": 1e999}"),
    ] {
        let e = resolve(
            &Source::HfConfig {
                name: "x".into(),
                text: text.into(),
            },
            &Overrides::default(),
        )
        .expect_err(name);
        out.push_str(&format!("## {name}\n{e}\n"));
    }
    insta::assert_snapshot!(out);
}

#[test]
fn auto_buckets_follow_sglang() {
    let b = specplan_compiler::config::auto_buckets(300);
    assert_eq!(&b[..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(&b[8..20], &[10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]);
    assert_eq!(&b[20..27], &[40, 44, 48, 52, 56, 60, 64]);
    assert_eq!(b[27], 72);
    assert_eq!(*b.iter().find(|&&x| x > 256).expect("a bucket past 256"), 272);
    assert_eq!(*b.last().expect("non-empty"), 288);
    assert_eq!(specplan_compiler::config::auto_buckets(64).len(), 27);
}

#[test]
fn out_of_range_flags_are_errors_not_panics() {
    let cases: Vec<Overrides> = vec![
        Overrides {
            topk: Some(40),
            num_steps: Some(1),
            num_draft_tokens: Some(2),
            ..Default::default()
        },
        Overrides {
            topk: Some(1),
            num_steps: Some(u32::MAX),
            num_draft_tokens: Some(3),
            ..Default::default()
        },
        Overrides {
            max_requests: Some(u32::MAX),
            ..Default::default()
        },
        Overrides {
            max_bs: Some(u32::MAX),
            buckets: Some("auto".into()),
            ..Default::default()
        },
    ];
    for o in cases {
        let e = resolve(&Source::Preset("tiny".into()), &o).expect_err("must be rejected");
        assert!(!e.0.is_empty());
    }
    let huge = r#"{"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1000000000,
                   "vocab_size": 10, "rms_norm_eps": 1e-50, "max_position_embeddings": 64}"#;
    let e = resolve(
        &Source::HfConfig {
            name: "x".into(),
            text: huge.into(),
        },
        &Overrides::default(),
    )
    .expect_err("huge");
    assert!(e.to_string().contains("num_hidden_layers"), "{e}");
}

/// A config whose activations would pass the config's lower bound (48 GiB) but whose
/// packed arena would not fit 64 GiB: since a bucket's rows are bounded by what the device
/// admission checks (8192), the bucket list is refused first, by the field that sets it —
/// never reported as a compiler bug.
#[test]
fn an_arena_past_64_gib_after_packing_names_the_buckets() {
    let text = r#"
[model]
hidden_size = 65536
intermediate_size = 16
num_attention_heads = 256
num_key_value_heads = 256
head_dim = 256
num_hidden_layers = 1
vocab_size = 1000
rms_norm_eps = 1e-5
rope_theta = 10000.0
max_position_embeddings = 4096

[speculative]
topk = 4
num_steps = 3
num_draft_tokens = 24

[capture]
buckets = "4096"
max_bs = 4096
page_size = 16
max_context_len = 64
max_requests = 4096
kv_pool_pages = 100
dtype = "bf16"
"#;
    let src = Source::Toml {
        name: "arena_after_packing".into(),
        text: text.into(),
    };
    let msg = resolve(&src, &Overrides::default())
        .map(|_| ())
        .expect_err("the largest bucket's rows exceed the device admission's")
        .to_string();
    assert!(
        msg.contains("capture.buckets (--buckets, --max-bs): the largest bucket 4096 × num_draft_tokens 24 = 98304 rows exceed 8192"),
        "{msg}"
    );
    assert!(!msg.contains("compiler bug"), "{msg}");
}

/// A Hugging Face config that is valid JSON but not an object is refused naming the file
/// (it named nothing: an empty field and "expected a table of model keys").
#[test]
fn a_json_config_that_is_not_an_object_names_its_file() {
    for text in ["[1, 2, 3]", "null", "4", "\"config\""] {
        let src = Source::HfConfig {
            name: "array".into(),
            text: text.into(),
        };
        let e = resolve(&src, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("array: expected a JSON object of model keys"), "{text}: {e}");
        assert_eq!(e.lines().count(), 2, "one error only: {e}");
    }
}

/// A Hugging Face config naming a key twice in one object is refused (serde_json would keep
/// the last value silently; TOML refuses such a file too).
#[test]
fn a_json_config_with_a_repeated_key_is_refused() {
    let text = r#"{"hidden_size": 256, "num_attention_heads": 4, "hidden_size": 512}"#;
    let src = Source::HfConfig {
        name: "dupkey".into(),
        text: text.into(),
    };
    let e = resolve(&src, &Overrides::default()).unwrap_err().to_string();
    assert!(
        e.contains("dupkey: not a usable config: key \"hidden_size\" appears twice in one object"),
        "{e}"
    );
}
