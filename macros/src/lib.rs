//! `include_plan!`: a plan compiled at build time and embedded in the binary.
//!
//! The macro runs the compiler (with NVRTC for the kernels) while the calling crate
//! builds, or loads a `.plan` file and validates it, and expands to a module with typed
//! constants and an accessor that decodes the embedded bytes: no file I/O at run time.
//! Errors are reported on the macro argument they concern, with the compiler's message.
//! Config files are registered with `include_bytes!`, so editing one rebuilds the crate.
//!
//! Kernels: a plan is compiled with its kernel binaries, so a build where NVRTC is missing
//! fails with the provisioning hint (`.ci/with-nvrtc <command>`) instead of embedding a
//! plan the GPU runtime cannot load. `kernels = false` asks for a plan without kernel
//! binaries explicitly (enough for the CPU executor); NVRTC is then not used at all. A
//! `.plan` file without binaries (`specplan compile --no-kernels`) needs `kernels = false`
//! too.

use std::path::PathBuf;

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Ident, Lit, LitStr, Token};

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::jit::Jit;
use specplan_compiler::{compile, Target};
use specplan_format::{encode, load_file};

struct Arg {
    key: Ident,
    value: Lit,
}

/// What the caller asked for, and what the build has: `Ok(Some(jit))` to compile kernels,
/// `Ok(None)` for a plan without kernel binaries (asked for with `kernels = false`; NVRTC
/// is not even looked for), or the error that fails the build (NVRTC missing, with its
/// provisioning hint).
fn kernel_jit<J, E: std::fmt::Display>(
    kernels: Option<bool>,
    nvrtc: impl FnOnce() -> Result<J, E>,
) -> Result<Option<J>, String> {
    if kernels == Some(false) {
        return Ok(None);
    }
    nvrtc().map(Some).map_err(|e| {
        format!(
            "include_plan! compiles the plan's kernels with NVRTC, which this build cannot use: {e}. \
             To embed a plan without kernel binaries (the CPU executor runs it; the GPU runtime \
             cannot), pass `kernels = false`"
        )
    })
}

/// A loaded plan without kernel binaries is embedded only when asked for.
fn check_binaries(kernels: Option<bool>, missing: usize, total: usize) -> Result<(), String> {
    if missing == 0 || kernels == Some(false) {
        return Ok(());
    }
    Err(format!(
        "{missing} of the plan's {total} kernels have no binary (it was compiled with --no-kernels); \
         compile it with NVRTC (`.ci/with-nvrtc specplan compile ...`) or pass `kernels = false` to embed it without"
    ))
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let key: Ident = input.parse()?;
        input.parse::<Token![=]>()?;
        let value: Lit = input.parse()?;
        Ok(Arg { key, value })
    }
}

struct Args(Punctuated<Arg, Token![,]>);

impl Parse for Args {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        Ok(Args(Punctuated::parse_terminated(input)?))
    }
}

fn string(a: &Arg) -> syn::Result<LitStr> {
    match &a.value {
        Lit::Str(s) => Ok(s.clone()),
        other => Err(syn::Error::new_spanned(
            other,
            format!("`{}` takes a string literal", a.key),
        )),
    }
}

fn boolean(a: &Arg) -> syn::Result<bool> {
    match &a.value {
        Lit::Bool(b) => Ok(b.value),
        other => Err(syn::Error::new_spanned(
            other,
            format!("`{}` takes true or false", a.key),
        )),
    }
}

fn int(a: &Arg) -> syn::Result<u32> {
    match &a.value {
        Lit::Int(i) => i.base10_parse::<u32>(),
        other => Err(syn::Error::new_spanned(
            other,
            format!("`{}` takes an integer literal", a.key),
        )),
    }
}

fn manifest_path(lit: &LitStr) -> syn::Result<PathBuf> {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .map_err(|_| syn::Error::new_spanned(lit, "CARGO_MANIFEST_DIR is not set (is this built by cargo?)"))?;
    let p = PathBuf::from(dir).join(lit.value());
    if !p.is_file() {
        return Err(syn::Error::new_spanned(lit, format!("file not found: {}", p.display())));
    }
    Ok(p)
}

/// `include_plan!(SOURCE, ARGS...)`: a plan compiled (or loaded) at build time, as a
/// module `plan` with constants and `plan::get()`.
///
/// - SOURCE, one of: `preset = "tiny"`, `config = "path.toml"`, `hf_config =
///   "config.json"` (paths relative to the calling crate's manifest), or `plan =
///   "p.plan"` (a compiled plan, validated).
/// - Overrides, as the CLI's flags: `topk`, `num_steps`, `num_draft_tokens`, `max_bs`,
///   `page_size`, `max_context_len`, `kv_pool_pages`, `max_requests`, `sliding_window`,
///   `hot_vocab_size` (integers), `buckets`, `dtype`, `outputs` (strings).
/// - `kernels = false`: embed a plan without kernel binaries; by default kernels are
///   compiled and a build without NVRTC fails (see the crate docs).
#[proc_macro]
pub fn include_plan(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand(input.into()).unwrap_or_else(|e| e.to_compile_error()).into()
}

fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let args: Args = syn::parse2(input)?;
    let mut source: Option<(Ident, LitStr)> = None;
    let mut o = Overrides::default();
    let mut kernels: Option<bool> = None;
    let mut tracked: Vec<PathBuf> = Vec::new();
    for a in &args.0 {
        let key = a.key.to_string();
        match key.as_str() {
            "preset" | "config" | "hf_config" | "plan" => {
                if let Some((prev, _)) = &source {
                    return Err(syn::Error::new_spanned(&a.key, format!("give one source: `{prev}` was already given")));
                }
                source = Some((a.key.clone(), string(a)?));
            }
            "topk" => o.topk = Some(int(a)?),
            "num_steps" => o.num_steps = Some(int(a)?),
            "num_draft_tokens" => o.num_draft_tokens = Some(int(a)?),
            "max_bs" => o.max_bs = Some(int(a)?),
            "page_size" => o.page_size = Some(int(a)?),
            "max_context_len" => o.max_context_len = Some(int(a)?),
            "kv_pool_pages" => o.kv_pool_pages = Some(int(a)?),
            "max_requests" => o.max_requests = Some(int(a)?),
            "sliding_window" => o.sliding_window = Some(int(a)?),
            "hot_vocab_size" => o.hot_vocab_size = Some(int(a)?),
            "buckets" => o.buckets = Some(string(a)?.value()),
            "dtype" => o.dtype = Some(string(a)?.value()),
            "outputs" => o.outputs = Some(string(a)?.value()),
            "kernels" => kernels = Some(boolean(a)?),
            _ => {
                return Err(syn::Error::new_spanned(
                    &a.key,
                    format!("unknown argument `{key}` (expected preset, config, hf_config, plan, topk, num_steps, num_draft_tokens, buckets, max_bs, page_size, max_context_len, kv_pool_pages, max_requests, dtype, outputs, sliding_window, hot_vocab_size, kernels)"),
                ))
            }
        }
    }
    let Some((kind, lit)) = source else {
        return Err(syn::Error::new(
            Span::call_site(),
            "give a source: preset = \"...\", config = \"...\", hf_config = \"...\" or plan = \"...\"",
        ));
    };
    let plan = if kind == "plan" {
        let path = manifest_path(&lit)?;
        tracked.push(path.clone());
        let plan = load_file(&path).map_err(|e| syn::Error::new_spanned(&lit, format!("{}: {e}", path.display())))?;
        let missing = plan.kernels.iter().filter(|k| k.binary.is_none()).count();
        check_binaries(kernels, missing, plan.kernels.len())
            .map_err(|m| syn::Error::new_spanned(&lit, format!("{}: {m}", path.display())))?;
        plan
    } else {
        let src = match kind.to_string().as_str() {
            "preset" => Source::Preset(lit.value()),
            k => {
                let path = manifest_path(&lit)?;
                let text =
                    specplan_format::read_config(&path).map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?;
                tracked.push(path.clone());
                let name = path
                    .file_stem()
                    .map_or("config".into(), |s| s.to_string_lossy().into_owned());
                if k == "config" {
                    Source::Toml { name, text }
                } else {
                    Source::HfConfig { name, text }
                }
            }
        };
        // The config first: its errors are reported wherever NVRTC is.
        let cfg = resolve(&src, &o).map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?;
        let jit = kernel_jit(kernels, Jit::from_env).map_err(|m| syn::Error::new(Span::call_site(), m))?;
        compile(&cfg, &Target::default(), jit.as_ref(), &|_, _| {})
            .map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?
            .plan
    };
    let bytes = encode(&plan).map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?;
    let bytes_lit = proc_macro2::Literal::byte_string(&bytes);
    let buckets: Vec<u32> = plan.buckets().iter().map(|b| b.batch).collect();
    let (n, topk, hidden, vocab) = (
        plan.spec.num_draft_tokens,
        plan.spec.topk,
        plan.model.hidden,
        plan.model.vocab,
    );
    let arena = plan.arena_bytes();
    let name = plan.name.clone();
    let deps = tracked.iter().map(|p| {
        let s = p.to_string_lossy().into_owned();
        quote! { const _: &[u8] = include_bytes!(#s); }
    });
    Ok(quote! {
        /// A plan embedded at build time by `include_plan!`.
        pub mod plan {
            #(#deps)*
            /// The plan's name (preset or config file stem).
            pub const NAME: &str = #name;
            /// Batch buckets, ascending.
            pub const BUCKETS: &[u32] = &[#(#buckets),*];
            pub const NUM_DRAFT_TOKENS: u32 = #n;
            pub const TOPK: u32 = #topk;
            pub const HIDDEN: u32 = #hidden;
            pub const VOCAB: u32 = #vocab;
            /// Bytes of the activation arena the runtime allocates.
            pub const ARENA_BYTES: u64 = #arena;
            /// The encoded plan (magic, version, checksum, body).
            pub const BYTES: &[u8] = #bytes_lit;

            /// The validated plan, decoded once from `BYTES` (no file I/O). It was validated
            /// at build time; decoding checks it again, so an error here means the binary
            /// itself was corrupted.
            pub fn get() -> ::core::result::Result<&'static ::specplan_format::ValidatedPlan, ::specplan_format::PlanError> {
                static PLAN: ::std::sync::OnceLock<
                    ::core::result::Result<::specplan_format::ValidatedPlan, ::specplan_format::PlanError>,
                > = ::std::sync::OnceLock::new();
                PLAN.get_or_init(|| ::specplan_format::decode(BYTES)).as_ref().map_err(|e| e.clone())
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missing() -> Result<u32, String> {
        Err("NVRTC (libnvrtc.so) was not found on the loader path; provision it with `.ci/with-nvrtc <command>`".into())
    }

    #[test]
    fn missing_nvrtc_fails_the_build_with_the_hint() {
        for asked in [None, Some(true)] {
            let e = kernel_jit(asked, missing).expect_err("a build without NVRTC must fail");
            assert!(e.contains("provision it with `.ci/with-nvrtc <command>`"), "{e}");
            assert!(e.contains("pass `kernels = false`"), "{e}");
        }
    }

    #[test]
    fn kernels_false_never_looks_for_nvrtc() {
        let r = kernel_jit(Some(false), || -> Result<u32, String> { panic!("NVRTC looked for") });
        assert_eq!(r, Ok(None));
    }

    #[test]
    fn available_nvrtc_compiles_kernels() {
        assert_eq!(kernel_jit(None, || Ok::<u32, String>(7)), Ok(Some(7)));
        assert_eq!(kernel_jit(Some(true), || Ok::<u32, String>(7)), Ok(Some(7)));
    }

    #[test]
    fn a_plan_file_without_binaries_needs_kernels_false() {
        assert!(check_binaries(None, 0, 8).is_ok());
        assert!(check_binaries(Some(false), 8, 8).is_ok());
        let e = check_binaries(None, 8, 8).expect_err("kernel-less plan embedded silently");
        assert!(e.contains("8 of the plan's 8 kernels have no binary"), "{e}");
        assert!(check_binaries(Some(true), 3, 8).is_err());
    }
}
