//! `#[derive(KernelParams)]`: parse → validate (spanned errors) → lay out → expand.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{spanned::Spanned, Data, DeriveInput, Fields, GenericArgument, PathArguments, Type};

/// What a field is on both sides of the ABI.
enum Kind {
    Ptr { mutable: bool, c_elem: &'static str },
    U32,
}

struct Field {
    name: String,
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
            Kind::Ptr { mutable: false, c_elem } => format!("const {c_elem}* {name};"),
            Kind::Ptr { mutable: true, c_elem } => format!("{c_elem}* {name};"),
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

fn field_kind(ty: &Type) -> syn::Result<Kind> {
    const HELP: &str =
        "unsupported kernel parameter type: use DevPtr<T> or DevPtrMut<T> with T one of i32, i64, f32, Act, or u32";
    let seg = last_segment(ty).ok_or_else(|| syn::Error::new(ty.span(), HELP))?;
    let name = seg.ident.to_string();
    match name.as_str() {
        "u32" if seg.arguments.is_empty() => Ok(Kind::U32),
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
            let c_elem = match last_segment(elem).map(|s| s.ident.to_string()).as_deref() {
                Some("i32") => "int",
                Some("i64") => "long long",
                Some("f32") => "float",
                Some("Act") => "act_t",
                _ => {
                    return Err(syn::Error::new(
                        elem.span(),
                        "unsupported pointer element type: use i32, i64, f32 or Act (the plan's activation type)",
                    ))
                }
            };
            Ok(Kind::Ptr {
                mutable: name == "DevPtrMut",
                c_elem,
            })
        }
        _ => Err(syn::Error::new(ty.span(), HELP)),
    }
}

fn has_repr_c(input: &DeriveInput) -> bool {
    input
        .attrs
        .iter()
        .any(|a| a.path().is_ident("repr") && a.parse_args::<syn::Ident>().map(|i| i == "C").unwrap_or(false))
}

pub fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
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
            let name = f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default();
            match field_kind(&f.ty) {
                Ok(kind) => fields.push(Field { name, kind }),
                Err(e) => push(e),
            }
        }
    }
    if let Some(e) = errors {
        return Err(e);
    }

    // C natural layout: each field at the next multiple of its size; struct size rounded to
    // the largest alignment.
    let mut offset = 0u32;
    let mut offsets = Vec::new();
    let mut align = 1u32;
    for f in &fields {
        let s = f.kind.size();
        offset = offset.div_ceil(s) * s;
        offsets.push(offset);
        offset += s;
        align = align.max(s);
    }
    let size = offset.div_ceil(align) * align;
    let ident = &input.ident;
    let c_name = ident.to_string();
    let mut decl = format!("struct {c_name} {{\n");
    for f in &fields {
        decl.push_str(&format!("    {}\n", f.kind.c_decl(&f.name)));
    }
    decl.push_str("};\n");
    decl.push_str(&format!(
        "static_assert(sizeof({c_name}) == {size}, \"{c_name}: size differs from the Rust side\");\n"
    ));
    decl.push_str(&format!(
        "static_assert(alignof({c_name}) == {align}, \"{c_name}: alignment differs from the Rust side\");\n"
    ));
    // Field offsets are asserted on the Rust side (`offset_of!` below): NVRTC's device
    // compilation has no `offsetof`. Size and alignment pin the C side.
    let field_entries = fields.iter().zip(&offsets).map(|(f, off)| {
        let name = &f.name;
        let (kind, mutable) = match f.kind {
            Kind::Ptr { mutable, .. } => (quote!(::specplan_kernels::abi::FieldKind::Ptr), mutable),
            Kind::U32 => (quote!(::specplan_kernels::abi::FieldKind::U32), false),
        };
        quote! { ::specplan_kernels::abi::Field { name: #name, kind: #kind, offset: #off, writes: #mutable } }
    });
    let rust_asserts = fields.iter().zip(&offsets).map(|(f, off)| {
        let id = syn::Ident::new(&f.name, proc_macro2::Span::call_site());
        let off = *off as usize;
        let msg = format!(
            "{c_name}.{}: rustc placed the field at another offset than the C side",
            f.name
        );
        quote! { assert!(::core::mem::offset_of!(#ident, #id) == #off, #msg); }
    });
    let size_usize = size as usize;
    let align_usize = align as usize;
    let size_msg = format!("{c_name}: rustc's size differs from the C layout");
    let align_msg = format!("{c_name}: rustc's alignment differs from the C layout");
    Ok(quote! {
        impl ::specplan_kernels::abi::KernelParams for #ident {
            const C_NAME: &'static str = #c_name;
            const C_DECL: &'static str = #decl;
            const SIZE: u32 = #size;
            const ALIGN: u32 = #align;
            const FIELDS: &'static [::specplan_kernels::abi::Field] = &[#(#field_entries),*];
        }
        const _: () = {
            assert!(::core::mem::size_of::<#ident>() == #size_usize, #size_msg);
            assert!(::core::mem::align_of::<#ident>() == #align_usize, #align_msg);
            #(#rust_asserts)*
        };
    })
}
