//! `include_plan!`: a plan compiled at build time and embedded in the binary.
//!
//! The macro runs the compiler (NVRTC too, where it is available) while the calling crate
//! builds, or loads a `.plan` file and validates it, and expands to a module with typed
//! constants and an accessor that decodes the embedded bytes: no file I/O at run time.
//! Errors are reported on the macro argument they concern, with the compiler's message.
//! Config files are registered with `include_bytes!`, so editing one rebuilds the crate.

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

/// See the crate docs; the argument list is documented on the re-export.
#[proc_macro]
pub fn include_plan(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand(input.into()).unwrap_or_else(|e| e.to_compile_error()).into()
}

fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let args: Args = syn::parse2(input)?;
    let mut source: Option<(Ident, LitStr)> = None;
    let mut o = Overrides::default();
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
            _ => {
                return Err(syn::Error::new_spanned(
                    &a.key,
                    format!("unknown argument `{key}` (expected preset, config, hf_config, plan, topk, num_steps, num_draft_tokens, buckets, max_bs, page_size, max_context_len, kv_pool_pages, max_requests, dtype, sliding_window, hot_vocab_size)"),
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
        load_file(&path).map_err(|e| syn::Error::new_spanned(&lit, format!("{}: {e}", path.display())))?
    } else {
        let src = match kind.to_string().as_str() {
            "preset" => Source::Preset(lit.value()),
            k => {
                let path = manifest_path(&lit)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| syn::Error::new_spanned(&lit, format!("cannot read {}: {e}", path.display())))?;
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
        let cfg = resolve(&src, &o).map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?;
        // Kernels are compiled when NVRTC is available to the build; a plan without
        // binaries still runs on the CPU executor.
        let jit = Jit::from_env().ok();
        compile(&cfg, &Target::default(), jit.as_ref(), &|_, _| {})
            .map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?
            .plan
    };
    let bytes = encode(&plan).map_err(|e| syn::Error::new_spanned(&lit, e.to_string()))?;
    let bytes_lit = proc_macro2::Literal::byte_string(&bytes);
    let buckets: Vec<u32> = plan.buckets.iter().map(|b| b.batch).collect();
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
