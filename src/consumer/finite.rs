//! A walk over a result as serde serializes it, refusing the floats JSON cannot hold: NaN and
//! the infinities. serde_json writes them as `null`, so a stored `f64::NAN` would replay as an
//! error and a stored `Some(f64::INFINITY)` as `None`: another value than the one that ran.

use std::fmt;

use serde::{Serialize, ser};

/// Fails when `value` holds a non-finite float, naming it.
pub(super) fn check<T: Serialize + ?Sized>(value: &T) -> Result<(), NonFinite> {
    value.serialize(Finite)
}

/// A non-finite float, or another error the value's `Serialize` raised.
#[derive(Debug)]
pub(super) struct NonFinite(pub(super) String);

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NonFinite {}

impl ser::Error for NonFinite {
    fn custom<M: fmt::Display>(message: M) -> Self {
        Self(message.to_string())
    }
}

struct Finite;

fn float(value: f64) -> Result<(), NonFinite> {
    match value.is_finite() {
        true => Ok(()),
        false => Err(NonFinite(format!("{value} has no JSON form; it would be stored as null"))),
    }
}

/// Every leaf but a float is fine; every compound walks its parts.
macro_rules! leaves {
    ($($method:ident($type:ty)),* $(,)?) => {
        $(fn $method(self, _value: $type) -> Result<(), NonFinite> { Ok(()) })*
    };
}

impl ser::Serializer for Finite {
    type Ok = ();
    type Error = NonFinite;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    leaves!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_struct(&'static str),
    );

    fn serialize_f32(self, value: f32) -> Result<(), NonFinite> {
        float(f64::from(value))
    }

    fn serialize_f64(self, value: f64) -> Result<(), NonFinite> {
        float(value)
    }

    fn serialize_none(self) -> Result<(), NonFinite> {
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), NonFinite> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<(), NonFinite> {
        Ok(())
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
    ) -> Result<(), NonFinite> {
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), NonFinite> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        value: &T,
    ) -> Result<(), NonFinite> {
        value.serialize(self)
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_tuple(self, _len: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_tuple_struct(self, _name: &'static str, _len: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self, NonFinite> {
        Ok(self)
    }
}

/// The parts of a compound: each walked in turn.
macro_rules! parts {
    ($($trait:ident :: $method:ident),* $(,)?) => {
        $(impl ser::$trait for Finite {
            type Ok = ();
            type Error = NonFinite;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), NonFinite> {
                value.serialize(Finite)
            }

            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        })*
    };
}

parts!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

impl ser::SerializeMap for Finite {
    type Ok = ();
    type Error = NonFinite;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), NonFinite> {
        key.serialize(Finite)
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), NonFinite> {
        value.serialize(Finite)
    }

    fn end(self) -> Result<(), NonFinite> {
        Ok(())
    }
}

/// A struct's fields, by name: each walked in turn.
macro_rules! fields {
    ($($trait:ident),* $(,)?) => {
        $(impl ser::$trait for Finite {
            type Ok = ();
            type Error = NonFinite;

            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                _key: &'static str,
                value: &T,
            ) -> Result<(), NonFinite> {
                value.serialize(Finite)
            }

            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        })*
    };
}

fields!(SerializeStruct, SerializeStructVariant);

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Serialize)]
    enum Reading {
        Plain(f64),
        Pair { low: f32, high: f64 },
    }

    #[test]
    fn finite_values_pass_and_every_non_finite_float_is_named() {
        assert!(check(&(1.5_f64, Some(2.0_f32), vec![0.0_f64], "text", 7_u8)).is_ok());
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(check(&bad).is_err());
            assert!(check(&Some(bad)).is_err());
            assert!(check(&vec![1.0, bad]).is_err());
            assert!(check(&(1, bad)).is_err());
            assert!(check(&BTreeMap::from([("k", bad)])).is_err());
            assert!(check(&Reading::Plain(bad)).is_err());
            assert!(check(&Reading::Pair { low: 1.0, high: bad }).is_err());
        }
        assert!(check(&f32::NAN).is_err());
        let error = check(&Some(f64::INFINITY)).unwrap_err();
        assert_eq!(error.to_string(), "inf has no JSON form; it would be stored as null");
    }
}
