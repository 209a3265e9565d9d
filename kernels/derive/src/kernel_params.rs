//! `#[derive(KernelParams)]`: parse → validate (spanned errors) → lay out → expand.
//!
//! From `struct FooParams { #[arg(buffer)] x: DevPtr<Act>, ..., rows: u32 }` it generates
//! - the C declaration (for the NVRTC prelude) with size and alignment `static_assert`s,
//!   and Rust-side `offset_of!` assertions that rustc's layout is the C one;
//! - the field table: name, offset, element type, access, the kinds of memory a pointer may
//!   name, and the input buffer it must be;
//! - `FooPtrs<P>` (one `P` per pointer field) and `FooScalars` (the `u32` fields): the typed
//!   argument builder, so a misnamed or missing argument is a compile error;
//! - `assemble` / `split` between those and the launch's argument list in field order.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::{spanned::Spanned, Data, DeriveInput, Fields, GenericArgument, PathArguments, Type};

/// What a pointer may name (the `#[arg(...)]` words).
#[derive(Default)]
struct Allowed {
    buffer: bool,
    weight: bool,
    table: bool,
    k_cache: bool,
    v_cache: bool,
    layout: bool,
    status: bool,
    counters: bool,
    local: bool,
    caller: bool,
    scratch: bool,
    rw: bool,
    input: Option<syn::Expr>,
}

/// What a field is on both sides of the ABI.
enum Kind {
    Ptr {
        mutable: bool,
        elem: &'static str,
        c_elem: &'static str,
        allowed: Box<Allowed>,
    },
    U32,
}

struct Field {
    ident: syn::Ident,
    kind: Kind,
}

impl Kind {
    fn size(&self) -> u32 {
        match self {
            Kind::Ptr { .. } => 8,
            Kind::U32 => 4,
        }
    }
    fn c_decl(&self, name: &str) -> String {
        match self {
            Kind::Ptr {
                mutable: false, c_elem, ..
            } => format!("const {c_elem}* {name};"),
            Kind::Ptr {
                mutable: true, c_elem, ..
            } => format!("{c_elem}* {name};"),
            Kind::U32 => format!("unsigned {name};"),
        }
    }
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        _ => None,
    }
}

/// (mutable, Rust element name, C element name) of a pointer type, or `None` for `u32`.
fn field_type(ty: &Type) -> syn::Result<Option<(bool, &'static str, &'static str)>> {
    const HELP: &str =
        "unsupported kernel parameter type: use DevPtr<T> or DevPtrMut<T> with T one of i32, i64, f32, Act, Stream, or u32";
    let seg = last_segment(ty).ok_or_else(|| syn::Error::new(ty.span(), HELP))?;
    let name = seg.ident.to_string();
    match name.as_str() {
        "u32" if seg.arguments.is_empty() => Ok(None),
        "DevPtr" | "DevPtrMut" => {
            let PathArguments::AngleBracketed(args) = &seg.arguments else {
                return Err(syn::Error::new(
                    seg.span(),
                    format!("{name} needs an element type, e.g. {name}<Act>"),
                ));
            };
            let elem = match args.args.first() {
                Some(GenericArgument::Type(t)) if args.args.len() == 1 => t,
                _ => {
                    return Err(syn::Error::new(
                        args.span(),
                        format!("{name} takes exactly one element type"),
                    ))
                }
            };
            let (rust, c) = match last_segment(elem).map(|s| s.ident.to_string()).as_deref() {
                Some("i32") => ("I32", "int"),
                Some("i64") => ("I64", "long long"),
                Some("f32") => ("F32", "float"),
                Some("Act") => ("Act", "act_t"),
                Some("Stream") => ("Stream", "stream_t"),
                _ => {
                    return Err(syn::Error::new(
                        elem.span(),
                        "unsupported pointer element type: use i32, i64, f32, Act (the plan's activation type) or Stream (the residual stream's)",
                    ))
                }
            };
            Ok(Some((name == "DevPtrMut", rust, c)))
        }
        _ => Err(syn::Error::new(ty.span(), HELP)),
    }
}

/// Reads `#[arg(buffer, weight, table, k_cache, v_cache, rw, input = "name")]`.
fn read_allowed(f: &syn::Field) -> syn::Result<Option<Allowed>> {
    let mut found: Option<Allowed> = None;
    for attr in f.attrs.iter().filter(|a| a.path().is_ident("arg")) {
        let a = found.get_or_insert_with(Allowed::default);
        attr.parse_nested_meta(|m| {
            let word = m.path.get_ident().map(|i| i.to_string()).unwrap_or_default();
            match word.as_str() {
                "buffer" => a.buffer = true,
                "weight" => a.weight = true,
                "table" => a.table = true,
                "k_cache" => a.k_cache = true,
                "v_cache" => a.v_cache = true,
                "layout" => a.layout = true,
                "status" => a.status = true,
                "counters" => a.counters = true,
                "caller" => a.caller = true,
                "scratch" => a.scratch = true,
                "rw" => a.rw = true,
                "local" => a.local = true,
                "input" => {
                    a.input = Some(m.value()?.parse::<syn::Expr>()?);
                    a.buffer = true;
                }
                _ => {
                    return Err(
                        m.error("unknown #[arg] word: use buffer, weight, table, k_cache, v_cache, layout, status, counters, caller, scratch, rw, local or input = NAME")
                    )
                }
            }
            Ok(())
        })?;
    }
    Ok(found)
}

fn has_repr_c(input: &DeriveInput) -> bool {
    input
        .attrs
        .iter()
        .any(|a| a.path().is_ident("repr") && a.parse_args::<syn::Ident>().map(|i| i == "C").unwrap_or(false))
}

fn parse(input: &DeriveInput) -> syn::Result<Vec<Field>> {
    let mut errors: Option<syn::Error> = None;
    let mut push = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };
    if !has_repr_c(input) {
        push(syn::Error::new_spanned(
            &input.ident,
            "KernelParams needs #[repr(C)]: the C side reads the struct with C layout",
        ));
    }
    if !input.generics.params.is_empty() {
        push(syn::Error::new_spanned(
            &input.generics,
            "KernelParams structs cannot be generic",
        ));
    }
    let named = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(f) => Some(f),
            other => {
                push(syn::Error::new_spanned(
                    other,
                    "KernelParams needs named fields (they name the C fields)",
                ));
                None
            }
        },
        _ => {
            push(syn::Error::new_spanned(
                &input.ident,
                "KernelParams can only be derived for structs",
            ));
            None
        }
    };
    let mut fields = Vec::new();
    if let Some(named) = named {
        if named.named.is_empty() {
            push(syn::Error::new_spanned(
                &input.ident,
                "a kernel needs at least one parameter",
            ));
        }
        for f in &named.named {
            let Some(ident) = f.ident.clone() else { continue };
            let allowed = match read_allowed(f) {
                Ok(a) => a,
                Err(e) => {
                    push(e);
                    continue;
                }
            };
            match field_type(&f.ty) {
                Ok(Some((mutable, elem, c_elem))) => {
                    let Some(allowed) = allowed else {
                        push(syn::Error::new_spanned(
                            &ident,
                            "a pointer parameter needs #[arg(...)] naming what it may point at \
                             (buffer, weight, table, k_cache, v_cache, layout, status, counters, caller, scratch, input = NAME)",
                        ));
                        continue;
                    };
                    if allowed.rw && !mutable {
                        push(syn::Error::new_spanned(&ident, "#[arg(rw)] needs a DevPtrMut"));
                    }
                    if allowed.local && (!mutable || allowed.rw) {
                        push(syn::Error::new_spanned(
                            &ident,
                            "#[arg(local)] needs a DevPtrMut, and excludes rw",
                        ));
                    }
                    fields.push(Field {
                        ident,
                        kind: Kind::Ptr {
                            mutable,
                            elem,
                            c_elem,
                            allowed: Box::new(allowed),
                        },
                    });
                }
                Ok(None) => {
                    if allowed.is_some() {
                        push(syn::Error::new_spanned(
                            &ident,
                            "#[arg(...)] applies to pointer fields only",
                        ));
                    }
                    fields.push(Field { ident, kind: Kind::U32 });
                }
                Err(e) => push(e),
            }
        }
    }
    match errors {
        Some(e) => Err(e),
        None => Ok(fields),
    }
}

/// C natural layout: each field at the next multiple of its size; the struct size rounded
/// to the largest alignment. Returns (offsets, size, align).
fn layout(fields: &[Field]) -> (Vec<u32>, u32, u32) {
    let mut offset = 0u32;
    let mut offsets = Vec::new();
    let mut align = 1u32;
    for f in fields {
        let s = f.kind.size();
        offset = offset.div_ceil(s) * s;
        offsets.push(offset);
        offset += s;
        align = align.max(s);
    }
    (offsets, offset.div_ceil(align) * align, align)
}

fn c_declaration(c_name: &str, fields: &[Field], size: u32, align: u32) -> String {
    let mut decl = format!("struct {c_name} {{\n");
    for f in fields {
        decl.push_str(&format!("    {}\n", f.kind.c_decl(&f.ident.to_string())));
    }
    decl.push_str("};\n");
    decl.push_str(&format!(
        "static_assert(sizeof({c_name}) == {size}, \"{c_name}: size differs from the Rust side\");\n"
    ));
    decl.push_str(&format!(
        "static_assert(alignof({c_name}) == {align}, \"{c_name}: alignment differs from the Rust side\");\n"
    ));
    decl
}

pub fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let fields = parse(input)?;
    let (offsets, size, align) = layout(&fields);
    let ident = &input.ident;
    let c_name = ident.to_string();
    let decl = c_declaration(&c_name, &fields, size, align);
    let base = c_name.strip_suffix("Params").unwrap_or(&c_name).to_string();
    let ptrs_ident = format_ident!("{}Ptrs", base);
    let scalars_ident = format_ident!("{}Scalars", base);
    let k = quote!(::specplan_kernels::abi);

    let field_entries = fields.iter().zip(&offsets).map(|(f, off)| {
        let name = f.ident.to_string();
        let kind = match &f.kind {
            Kind::U32 => quote!(#k::FieldKind::U32),
            Kind::Ptr {
                mutable,
                elem,
                allowed: a,
                ..
            } => {
                let elem = format_ident!("{}", elem);
                let access = match (mutable, a.rw, a.local) {
                    (false, _, _) => quote!(#k::Access::Read),
                    (true, _, true) => quote!(#k::Access::WriteRead),
                    (true, false, false) => quote!(#k::Access::Write),
                    (true, true, false) => quote!(#k::Access::ReadWrite),
                };
                let (buffer, weight, table, kc, vc) = (a.buffer, a.weight, a.table, a.k_cache, a.v_cache);
                let (layout, status, caller, scratch) = (a.layout, a.status, a.caller, a.scratch);
                let counters = a.counters;
                let input = match &a.input {
                    Some(s) => quote!(::core::option::Option::Some(#s)),
                    None => quote!(::core::option::Option::None),
                };
                quote! {
                    #k::FieldKind::Ptr(#k::PtrField {
                        elem: #k::Elem::#elem,
                        access: #access,
                        allowed: #k::Allowed {
                            buffer: #buffer, weight: #weight, table: #table, k_cache: #kc, v_cache: #vc,
                            layout: #layout, status: #status, counters: #counters, caller: #caller,
                            scratch: #scratch,
                        },
                        input: #input,
                    })
                }
            }
        };
        quote! { #k::Field { name: #name, offset: #off, kind: #kind } }
    });
    let rust_asserts = fields.iter().zip(&offsets).map(|(f, off)| {
        let id = &f.ident;
        let off = *off as usize;
        let msg = format!("{c_name}.{id}: rustc placed the field at another offset than the C side");
        quote! { assert!(::core::mem::offset_of!(#ident, #id) == #off, #msg); }
    });

    let ptr_fields: Vec<&syn::Ident> = fields
        .iter()
        .filter(|f| matches!(f.kind, Kind::Ptr { .. }))
        .map(|f| &f.ident)
        .collect();
    let scalar_fields: Vec<&syn::Ident> = fields
        .iter()
        .filter(|f| matches!(f.kind, Kind::U32))
        .map(|f| &f.ident)
        .collect();
    // assemble: every field in declaration order.
    let assemble_items = fields.iter().map(|f| {
        let id = &f.ident;
        match f.kind {
            Kind::Ptr { .. } => quote!(#k::Slot::Ptr(p.#id)),
            Kind::U32 => quote!(#k::Slot::U32(s.#id)),
        }
    });
    // split: read field i of the slot list.
    let split_ptrs = fields.iter().enumerate().filter_map(|(i, f)| {
        let id = &f.ident;
        matches!(f.kind, Kind::Ptr { .. })
            .then(|| quote!(#id: match slots.get(#i)? { #k::Slot::Ptr(x) => x.clone(), _ => return None }))
    });
    let split_scalars = fields.iter().enumerate().filter_map(|(i, f)| {
        let id = &f.ident;
        matches!(f.kind, Kind::U32)
            .then(|| quote!(#id: match slots.get(#i)? { #k::Slot::U32(x) => *x, _ => return None }))
    });
    let nfields = fields.len();
    let size_usize = size as usize;
    let align_usize = align as usize;
    let size_msg = format!("{c_name}: rustc's size differs from the C layout");
    let align_msg = format!("{c_name}: rustc's alignment differs from the C layout");
    let ptrs_doc = format!("The pointer arguments of `{c_name}`, one `P` each (a typed launch builder).");
    let scalars_doc = format!("The `u32` arguments of `{c_name}`.");
    let _ = Span::call_site();
    Ok(quote! {
        #[doc = #ptrs_doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct #ptrs_ident<P> { #(pub #ptr_fields: P,)* }

        #[doc = #scalars_doc]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct #scalars_ident { #(pub #scalar_fields: u32,)* }

        impl<P> #ptrs_ident<P> {
            /// The pointers in field order.
            pub fn into_vec(self) -> ::std::vec::Vec<P> {
                ::std::vec![#(self.#ptr_fields),*]
            }
            /// The same struct with every pointer mapped.
            pub fn map<Q>(self, mut f: impl FnMut(P) -> Q) -> #ptrs_ident<Q> {
                #ptrs_ident { #(#ptr_fields: f(self.#ptr_fields),)* }
            }
        }

        impl #k::KernelParams for #ident {
            const C_NAME: &'static str = #c_name;
            const C_DECL: &'static str = #decl;
            const SIZE: u32 = #size;
            const ALIGN: u32 = #align;
            const FIELDS: &'static [#k::Field] = &[#(#field_entries),*];
            type Ptrs<P> = #ptrs_ident<P>;
            type Scalars = #scalars_ident;

            fn assemble<P>(p: #ptrs_ident<P>, s: #scalars_ident) -> ::std::vec::Vec<#k::Slot<P>> {
                let _ = &s;
                ::std::vec![#(#assemble_items),*]
            }

            fn split<P: ::core::clone::Clone>(slots: &[#k::Slot<P>]) -> ::core::option::Option<(#ptrs_ident<P>, #scalars_ident)> {
                if slots.len() != #nfields {
                    return ::core::option::Option::None;
                }
                ::core::option::Option::Some((
                    #ptrs_ident { #(#split_ptrs,)* },
                    #scalars_ident { #(#split_scalars,)* },
                ))
            }

            fn ptr_list<P>(p: #ptrs_ident<P>) -> ::std::vec::Vec<P> {
                p.into_vec()
            }
        }
        const _: () = {
            assert!(::core::mem::size_of::<#ident>() == #size_usize, #size_msg);
            assert!(::core::mem::align_of::<#ident>() == #align_usize, #align_msg);
            #(#rust_asserts)*
        };
    })
}
