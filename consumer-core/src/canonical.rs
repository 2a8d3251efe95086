//! Whether a payload's bytes are already its canonical JSON (the form
//! [`canonical_hash`](crate::key::canonical_hash) hashes), so that its hash is the hash of the
//! bytes as they are and the message can be decoded from them directly, without a
//! `serde_json::Value` tree in between.
//!
//! The check accepts only what the canonical form writes byte for byte, and is conservative
//! about the rest: no white space; object keys in strictly ascending byte order (so no
//! repeated key); strings without escapes or control characters; integers as serde_json
//! reads and writes them (no leading zero, no `-0`, within `u64`, or `i64` when negative);
//! no fractions or exponents; `true`, `false`, `null`. Anything else (a float, an escaped
//! character, keys out of order) is not an error: that payload takes the tree.

/// Nesting deeper than this is left to the tree (serde_json's own limit is 128).
const MAX_DEPTH: usize = 100;

/// Whether `payload` is valid JSON, valid UTF-8, and exactly its canonical form.
pub(crate) fn is_canonical(payload: &[u8]) -> bool {
    // Outside strings the reader takes ASCII bytes only, and each string's text is checked
    // as UTF-8 where it is not ASCII: so the payload as a whole is UTF-8 once it is read.
    let mut reader = Reader {
        bytes: payload,
        at: 0,
    };
    reader.value(0).is_some() && reader.at == payload.len()
}

/// A cursor over the payload; each step returns `None` where the bytes stop being canonical.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string().map(drop),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    /// Opens an object or array (`open`, `close`) at `depth`; `Some(true)` if it is empty
    /// (and so already closed).
    fn open(&mut self, open: u8, close: u8, depth: usize) -> Option<bool> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(open)?;
        Some(self.eat(close).is_some())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if self.open(b'{', b'}', depth)? {
            return Some(());
        }
        let mut last: Option<&[u8]> = None;
        loop {
            let key = self.string()?;
            // Strictly ascending: sorted as the canonical form writes them, none twice.
            if last.is_some_and(|l| l >= key) {
                return None;
            }
            last = Some(key);
            self.eat(b':')?;
            self.value(depth)?;
            if self.eat(b',').is_none() {
                return self.eat(b'}');
            }
        }
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if self.open(b'[', b']', depth)? {
            return Some(());
        }
        loop {
            self.value(depth)?;
            if self.eat(b',').is_none() {
                return self.eat(b']');
            }
        }
    }

    /// A string without escapes or control characters (those the canonical form would
    /// write escaped), whose text is UTF-8: its bytes between the quotes.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = self.bytes.get(start..)?;
        let (len, ascii) = string_end(rest)?;
        let text = rest.get(..len)?;
        if !ascii {
            std::str::from_utf8(text).ok()?;
        }
        self.at = start + len;
        self.eat(b'"')?;
        Some(text)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.bytes
            .get(self.at..)?
            .starts_with(word)
            .then(|| self.at += word.len())
    }

    /// An integer as serde_json writes the number it reads from it: no leading zero, no
    /// `-0` (read as a float), and in range (larger ones are read as floats).
    fn integer(&mut self) -> Option<()> {
        let negative = self.eat(b'-').is_some();
        let start = self.at;
        let rest = self.bytes.get(start..)?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        self.at = start + digits;
        if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        match rest.get(..digits)? {
            [] => None,
            [b'0'] => (!negative).then_some(()),
            [b'0', ..] => None,
            text => {
                let magnitude: u64 = std::str::from_utf8(text).ok()?.parse().ok()?;
                (!negative || magnitude <= 1 << 63).then_some(())
            }
        }
    }
}

/// Where the string text at the start of `rest` ends (its closing quote), and whether it is
/// all ASCII; `None` at an escape or a control character, or without a closing quote.
///
/// A block of [`BLOCK`] bytes is looked at at once while none of them is special: each test
/// is made of every byte without a branch, which the compiler turns into vector compares.
/// The block that holds a special byte, and the rest after the last whole block, are read
/// again byte by byte.
fn string_end(rest: &[u8]) -> Option<(usize, bool)> {
    // The blocks' words or-ed together: a byte's high bit set tells of non-ASCII text.
    let mut high = 0u64;
    let mut at = 0;
    while let Some(block) = rest.get(at..at + BLOCK) {
        let special = block.iter().fold(0u8, |special, &b| {
            special | u8::from(b == b'"') | u8::from(b == b'\\') | u8::from(b < 0x20)
        });
        if special != 0 {
            break;
        }
        for word in block.chunks_exact(8) {
            high |= u64::from_ne_bytes(word.try_into().ok()?);
        }
        at += BLOCK;
    }
    let mut ascii = high & u64::from_ne_bytes([0x80; 8]) == 0;
    for (i, &b) in rest.get(at..)?.iter().enumerate() {
        match b {
            b'"' => return Some((at + i, ascii)),
            b'\\' | 0..0x20 => return None,
            _ => ascii &= b.is_ascii(),
        }
    }
    None
}

/// The bytes [`string_end`] looks at at once.
const BLOCK: usize = 16;

#[cfg(test)]
mod tests {
    use super::{is_canonical, string_end};

    /// The byte-at-a-time reading [`string_end`] must agree with.
    fn string_end_bytewise(rest: &[u8]) -> Option<(usize, bool)> {
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        (rest[len] == b'"').then(|| (len, rest[..len].is_ascii()))
    }

    #[test]
    fn strings_end_where_a_byte_at_a_time_reading_ends_them() {
        // Each special byte, and a non-ASCII one, at every place of strings of up to three
        // blocks, with and without a closing quote after.
        for len in 0..3 * super::BLOCK {
            for at in 0..=len {
                for special in [b'"', b'\\', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xc3, 0xff] {
                    let mut text = vec![b'x'; len];
                    if at < len {
                        text[at] = special;
                    }
                    for tail in [&b""[..], b"\"", b"\"}"] {
                        let bytes = [&text[..], tail].concat();
                        assert_eq!(string_end(&bytes), string_end_bytewise(&bytes), "{bytes:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn text_that_is_not_utf8_is_not_canonical_wherever_it_is() {
        assert!(is_canonical(
            "{\"käse\":\"ünïcödé and more than eight\"}".as_bytes()
        ));
        for payload in [
            &b"{\"a\":\"more than eight bytes \xff\"}"[..],
            b"{\"more than eight bytes \xc3\":1}",
            b"[\"\xe2\x82\"]",
            b"\"twelve bytes\xc3\"",
        ] {
            assert!(!is_canonical(payload), "{payload:?}");
        }
    }

    #[test]
    fn the_canonical_form_is_recognised() {
        for payload in [
            r#"{"body":"xxx","id":7}"#,
            "{\"\":null,\"a\":[1,-2,true,false,{}],\"b\":{\"c\":[],\"d\":\"é/\u{7f}\"}}",
            "[]",
            "0",
            "-9223372036854775808",
            "18446744073709551615",
            r#""text""#,
        ] {
            assert!(is_canonical(payload.as_bytes()), "{payload}");
        }
    }

    #[test]
    fn anything_the_canonical_form_would_write_otherwise_is_not() {
        for payload in [
            r#"{"id":7,"body":"xxx"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a": 1}"#,
            " {}",
            "{}\n",
            r#"{"a":"line\nbreak"}"#,
            r#"{"a":"\u00e9"}"#,
            r#"{"a\"b":1}"#,
            "-0",
            "01",
            "1.0",
            "1e3",
            "-9223372036854775809",
            "18446744073709551616",
            "[1,]",
            "{",
            "tru",
            "",
            "[1]x",
        ] {
            assert!(!is_canonical(payload.as_bytes()), "{payload}");
        }
        assert!(!is_canonical(b"\"\xff\""));
        let deep = format!("{}{}", "[".repeat(101), "]".repeat(101));
        assert!(!is_canonical(deep.as_bytes()));
    }
}
