//! Serializing a value into its canonical form, refusing what JSON cannot carry exactly.

use serde::ser::{self, Serialize};

use super::{Canon, CanonicalJsonError, CanonicalJsonErrorKind, integer, number};

/// Serializes a value into a [`Canon`], refusing what JSON cannot carry exactly.
pub(super) struct ValueSerializer;

type Result<T, E = CanonicalJsonError> = std::result::Result<T, E>;

/// The narrower integers' methods, each widening its value to the 128-bit one of its sign.
macro_rules! widened {
    ($($narrow:ident($ty:ty)),+ => $wide:ident($wide_ty:ty)) => {$(
        fn $narrow(self, v: $ty) -> Result<Canon> {
            self.$wide(<$wide_ty>::from(v))
        }
    )+};
}

impl ser::Serializer for ValueSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    type SerializeSeq = SeqSerializer;
    type SerializeTuple = SeqSerializer;
    type SerializeTupleStruct = SeqSerializer;
    type SerializeTupleVariant = SeqSerializer;
    type SerializeMap = MapSerializer;
    type SerializeStruct = MapSerializer;
    type SerializeStructVariant = MapSerializer;

    fn serialize_bool(self, v: bool) -> Result<Canon> {
        Ok(Canon::Bool(v))
    }
    widened!(
        serialize_i8(i8), serialize_i16(i16), serialize_i32(i32), serialize_i64(i64)
            => serialize_i128(i128)
    );
    fn serialize_i128(self, v: i128) -> Result<Canon> {
        integer(v.unsigned_abs(), v < 0)
    }
    widened!(
        serialize_u8(u8), serialize_u16(u16), serialize_u32(u32), serialize_u64(u64)
            => serialize_u128(u128)
    );
    fn serialize_u128(self, v: u128) -> Result<Canon> {
        integer(v, false)
    }
    fn serialize_f32(self, v: f32) -> Result<Canon> {
        // As JSON writes it (the shortest digits that read back as this f32), then as a double,
        // so that 0.1f32 is 0.1 as in the other languages.
        if !v.is_finite() {
            return number(f64::from(v));
        }
        number(v.to_string().parse().unwrap_or(f64::from(v)))
    }
    fn serialize_f64(self, v: f64) -> Result<Canon> {
        number(v)
    }
    fn serialize_char(self, v: char) -> Result<Canon> {
        Ok(Canon::String(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> Result<Canon> {
        Ok(Canon::String(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Canon> {
        Ok(Canon::Array(
            v.iter().map(|b| Canon::Number(f64::from(*b))).collect(),
        ))
    }
    fn serialize_none(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Canon> {
        Ok(Canon::String(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Canon> {
        Ok(Canon::Object(vec![(
            variant.to_owned(),
            value.serialize(self)?,
        )]))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<SeqSerializer> {
        Ok(SeqSerializer::new(None, len.unwrap_or(0)))
    }
    fn serialize_tuple(self, len: usize) -> Result<SeqSerializer> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<SeqSerializer> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<SeqSerializer> {
        Ok(SeqSerializer::new(Some(variant), len))
    }
    fn serialize_map(self, len: Option<usize>) -> Result<MapSerializer> {
        Ok(MapSerializer::new(None, len.unwrap_or(0)))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<MapSerializer> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<MapSerializer> {
        Ok(MapSerializer::new(Some(variant), len))
    }
}

/// `{"Variant": inner}`, serde's external tagging, or `inner` itself.
fn tagged(variant: Option<&'static str>, inner: Canon) -> Canon {
    match variant {
        Some(variant) => Canon::Object(vec![(variant.to_owned(), inner)]),
        None => inner,
    }
}

pub(super) struct SeqSerializer {
    variant: Option<&'static str>,
    elements: Vec<Canon>,
}

impl SeqSerializer {
    /// An array of `len` elements (a hint), tagged with the variant when there is one.
    fn new(variant: Option<&'static str>, len: usize) -> Self {
        Self {
            variant,
            elements: Vec::with_capacity(len),
        }
    }
    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.elements.push(value.serialize(ValueSerializer)?);
        Ok(())
    }
    fn finish(self) -> Result<Canon> {
        Ok(tagged(self.variant, Canon::Array(self.elements)))
    }
}

/// The four sequence traits, which differ only in the name of the method that adds an element.
macro_rules! sequence {
    ($($trait:ident :: $add:ident),+) => {$(
        impl ser::$trait for SeqSerializer {
            type Ok = Canon;
            type Error = CanonicalJsonError;
            fn $add<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
                self.push(value)
            }
            fn end(self) -> Result<Canon> {
                self.finish()
            }
        }
    )+};
}

sequence!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

pub(super) struct MapSerializer {
    variant: Option<&'static str>,
    members: Vec<(String, Canon)>,
    key: Option<String>,
}

impl MapSerializer {
    /// An object of `len` members (a hint), tagged with the variant when there is one.
    fn new(variant: Option<&'static str>, len: usize) -> Self {
        Self {
            variant,
            members: Vec::with_capacity(len),
            key: None,
        }
    }
    fn finish(self) -> Result<Canon> {
        Ok(tagged(self.variant, Canon::object(self.members)?))
    }
}

impl ser::SerializeMap for MapSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        self.key = Some(match key.serialize(ValueSerializer)? {
            Canon::String(name) => name,
            // Integer keys are written as strings, as serde_json writes them.
            Canon::Number(number) => ryu_js::Buffer::new().format_finite(number).to_owned(),
            _ => {
                return Err(CanonicalJsonError::new(
                    CanonicalJsonErrorKind::NotJson,
                    "a map key must be a string or an integer",
                ));
            }
        });
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let key = self
            .key
            .take()
            .ok_or_else(|| ser::Error::custom("a map value without its key"))?;
        self.members.push((key, value.serialize(ValueSerializer)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

/// Structs and struct variants: named fields, members of an object.
macro_rules! fields {
    ($($trait:ident),+) => {$(
        impl ser::$trait for MapSerializer {
            type Ok = Canon;
            type Error = CanonicalJsonError;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<()> {
                self.members.push((key.to_owned(), value.serialize(ValueSerializer)?));
                Ok(())
            }
            fn end(self) -> Result<Canon> {
                self.finish()
            }
        }
    )+};
}

fields!(SerializeStruct, SerializeStructVariant);
