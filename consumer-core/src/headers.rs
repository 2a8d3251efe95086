//! [`Headers`]: a delivery's text headers, in one shared allocation.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;

use crate::blocks::Blocks;

/// A delivery's headers as text: names and values, in name order, each name once.
///
/// Built once per message by its transport and shared by every hand-out of it: all names
/// and values sit in one allocation (none for no headers), so cloning is a reference count
/// and dropping frees one block. Changing one ([`Headers::insert`], [`Headers::remove`])
/// writes a new block, leaving other clones as they were.
///
/// Building from pairs keeps the last value of a repeated name, as inserting them into a map
/// in turn would.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    /// Entries in name order, each `name length (u32 LE), value length (u32 LE), name,
    /// value`; `None` when there are none.
    block: Option<Block>,
}

/// Where a [`Headers`]' entries are: a block of their own, or a slice of a transport's
/// [`Blocks`]. Equal when their entries are.
#[derive(Clone)]
enum Block {
    Own(Arc<[u8]>),
    Shared(Bytes),
}

impl PartialEq for Block {
    fn eq(&self, other: &Block) -> bool {
        **self == **other
    }
}

impl Eq for Block {}

impl Deref for Block {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Block::Own(block) => block,
            Block::Shared(block) => block,
        }
    }
}

/// Bytes an entry takes before its name and value: their two lengths.
const PREFIX: usize = 8;

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers::default()
    }

    /// The value of header `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.raw(name)?).ok()
    }

    /// The value of header `name` as bytes of its own, for a value that outlives these
    /// headers (a [`MessageId`](crate::transport::MessageId), say). Headers a transport built in
    /// one of its shared blocks hand out a slice of that block (no copy); others a copy.
    pub fn get_bytes(&self, name: &str) -> Option<Bytes> {
        let value = self.raw(name)?;
        Some(match &self.block {
            Some(Block::Shared(block)) => block.slice_ref(value),
            _ => Bytes::copy_from_slice(value),
        })
    }

    /// The bytes of header `name`'s value, in the block.
    fn raw(&self, name: &str) -> Option<&[u8]> {
        // Names are compared as bytes; the entries are in name order, so the search stops at
        // the first name past `name`.
        let mut entries = self.iter();
        while let Some((n, value)) = entries.next_raw() {
            match n.cmp(name.as_bytes()) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => return Some(value),
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }

    /// Whether there is a header `name`.
    pub fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// The headers, in name order.
    pub fn iter(&self) -> HeaderIter<'_> {
        HeaderIter {
            rest: self.block.as_deref().unwrap_or_default(),
        }
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.block.is_none()
    }

    /// Sets header `name` to `value` (replacing its value if it has one).
    pub fn insert(&mut self, name: impl AsRef<str>, value: impl AsRef<str>) {
        let (name, value) = (name.as_ref(), value.as_ref());
        let others = self.iter().filter(|(n, _)| *n != name);
        *self = others.chain(std::iter::once((name, value))).collect();
    }

    /// Removes header `name`; returns whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        if !self.contains_key(name) {
            return false;
        }
        *self = self.iter().filter(|(n, _)| *n != name).collect();
        true
    }

    /// The headers as an owned map.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        self.iter()
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect()
    }

    /// Headers from pairs in any order (the last of a repeated name wins). Pairs in
    /// strictly ascending name order (as most transports read them, and as
    /// [`Headers::iter`] yields them) are read twice and written straight into the block:
    /// one allocation, nothing transient.
    pub fn from_pairs<'a, I>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
        I::IntoIter: Clone,
    {
        Headers::build(pairs.into_iter(), |size, pairs| {
            // Collected from an iterator of known length: allocated once, at its size.
            let mut block: Arc<[u8]> = std::iter::repeat_n(0, size).collect();
            if let Some(buffer) = Arc::get_mut(&mut block) {
                let mut at = 0;
                write(pairs, |part| {
                    buffer[at..at + part.len()].copy_from_slice(part);
                    at += part.len();
                });
            }
            Block::Own(block)
        })
    }

    /// [`Headers::from_pairs`], with the entries written into `blocks` (see [`Blocks`]):
    /// pairs in name order then cost no allocation of their own. For a transport that copies
    /// each message's bytes out of its client's buffers.
    pub fn from_pairs_in<'a, I>(pairs: I, blocks: &mut Blocks) -> Self
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
        I::IntoIter: Clone,
    {
        Headers::build(pairs.into_iter(), |size, pairs| {
            blocks.reserve(size);
            let block = blocks.block();
            write(pairs, |part| block.extend_from_slice(part));
            Block::Shared(blocks.split())
        })
    }

    /// Headers from `pairs`: those in strictly ascending name order are written by `block`
    /// (given the size of their entries), any others sorted first.
    fn build<'a, I>(pairs: I, block: impl FnOnce(usize, I) -> Block) -> Self
    where
        I: Iterator<Item = (&'a str, &'a str)> + Clone,
    {
        match entries_size(pairs.clone()) {
            None => pairs.collect(),
            Some(0) => Headers::new(),
            Some(size) => Headers {
                block: Some(block(size, pairs)),
            },
        }
    }
}

/// The bytes `pairs` take as entries, if they are in strictly ascending name order (`None`
/// if not).
fn entries_size<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Option<usize> {
    let mut last: Option<&str> = None;
    let mut size = 0;
    for (name, value) in pairs {
        if last.is_some_and(|l| l >= name) {
            return None;
        }
        last = Some(name);
        size += PREFIX + name.len() + value.len();
    }
    Some(size)
}

/// Writes `pairs` (in name order, each name once) as entries, part by part, to `out`.
fn write<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>, mut out: impl FnMut(&[u8])) {
    for (name, value) in pairs {
        out(&len(name).to_le_bytes());
        out(&len(value).to_le_bytes());
        out(name.as_bytes());
        out(value.as_bytes());
    }
}

/// A length as an entry stores it. A header longer than 4 GiB cannot reach a delivery
/// (every transport's messages are smaller), so this saturates rather than fail.
fn len(s: &str) -> u32 {
    u32::try_from(s.len()).unwrap_or(u32::MAX)
}

impl<'a> FromIterator<(&'a str, &'a str)> for Headers {
    fn from_iter<I: IntoIterator<Item = (&'a str, &'a str)>>(pairs: I) -> Self {
        let mut pairs: Vec<(&str, &str)> = pairs.into_iter().collect();
        // Stable: of a repeated name, the last stays last, and is the one kept.
        pairs.sort_by(|a, b| a.0.cmp(b.0));
        let mut kept: Vec<(&str, &str)> = Vec::with_capacity(pairs.len());
        for pair in pairs {
            match kept.last_mut() {
                Some(last) if last.0 == pair.0 => *last = pair,
                _ => kept.push(pair),
            }
        }
        Headers::from_pairs(kept)
    }
}

impl From<&BTreeMap<String, String>> for Headers {
    fn from(map: &BTreeMap<String, String>) -> Self {
        Headers::from_pairs(map.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    }
}

impl From<BTreeMap<String, String>> for Headers {
    fn from(map: BTreeMap<String, String>) -> Self {
        Headers::from(&map)
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a str);
    type IntoIter = HeaderIter<'a>;

    fn into_iter(self) -> HeaderIter<'a> {
        self.iter()
    }
}

/// The headers of a [`Headers`], in name order (see [`Headers::iter`]).
#[derive(Debug, Clone)]
pub struct HeaderIter<'a> {
    rest: &'a [u8],
}

impl<'a> HeaderIter<'a> {
    /// The next entry's name and value as bytes, not checked as text.
    fn next_raw(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        let (lengths, rest) = self.rest.split_first_chunk::<PREFIX>()?;
        let [n0, n1, n2, n3, v0, v1, v2, v3] = *lengths;
        let name_len = u32::from_le_bytes([n0, n1, n2, n3]) as usize;
        let value_len = u32::from_le_bytes([v0, v1, v2, v3]) as usize;
        let (name, rest) = rest.split_at_checked(name_len)?;
        let (value, rest) = rest.split_at_checked(value_len)?;
        self.rest = rest;
        Some((name, value))
    }
}

impl<'a> Iterator for HeaderIter<'a> {
    type Item = (&'a str, &'a str);

    fn next(&mut self) -> Option<(&'a str, &'a str)> {
        let (name, value) = self.next_raw()?;
        // Written from `&str` parts only, so both are UTF-8; a block that were not would
        // end the iteration rather than show bytes as text.
        Some((
            std::str::from_utf8(name).ok()?,
            std::str::from_utf8(value).ok()?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_back_in_name_order_with_the_last_of_a_repeated_name() {
        let h = Headers::from_pairs([("b", "2"), ("a", "1"), ("b", "3"), ("", "empty")]);
        let read: Vec<_> = h.iter().collect();
        assert_eq!(read, [("", "empty"), ("a", "1"), ("b", "3")]);
        assert_eq!(h.get("b"), Some("3"));
        assert_eq!(h.get("c"), None);
        // Found by name order: before the first name, between two, and a name's prefix.
        assert_eq!(h.get(" "), None);
        assert_eq!(h.get("aa"), None);
        assert_eq!(h.get("a"), Some("1"));
        assert_eq!(h.get(""), Some("empty"));
        assert_eq!(h.len(), 3);
        assert_eq!(format!("{h:?}"), r#"{"": "empty", "a": "1", "b": "3"}"#);
    }

    /// A value read out as bytes of its own is a slice of the block when the headers sit in
    /// a transport's shared block, and a copy of equal text when they have one of their own.
    #[test]
    fn a_value_read_as_bytes_shares_a_transports_block() {
        let mut blocks = Blocks::default();
        let shared = Headers::from_pairs_in([("a", "1"), ("id", "m-1")], &mut blocks);
        let value = shared.get_bytes("id").expect("a value");
        assert_eq!(&value[..], b"m-1");
        assert_eq!(
            value.as_ptr(),
            shared.get("id").map(str::as_ptr).expect("a value")
        );
        assert_eq!(shared.get_bytes("b"), None);

        let own = Headers::from_pairs([("a", "1"), ("id", "m-1")]);
        let copy = own.get_bytes("id").expect("a value");
        assert_eq!(&copy[..], b"m-1");
        assert_ne!(
            copy.as_ptr(),
            own.get("id").map(str::as_ptr).expect("a value")
        );
    }

    #[test]
    fn pairs_in_name_order_make_the_same_headers_as_any_other_order() {
        let sorted = Headers::from_pairs([("a", "1"), ("b", "ü"), ("c", "")]);
        let shuffled = Headers::from_pairs([("c", ""), ("a", "1"), ("b", "ü")]);
        assert_eq!(sorted, shuffled);
        let map = sorted.to_map();
        assert_eq!(Headers::from(&map), sorted);
        assert_eq!(map["b"], "ü");
    }

    #[test]
    fn changing_a_clone_leaves_the_original_as_it_was() {
        let original = Headers::from_pairs([("attempt", "1"), ("id", "m-1")]);
        let mut changed = original.clone();
        changed.insert("attempt", "2");
        changed.insert("z", "last");
        assert_eq!(changed.get("attempt"), Some("2"));
        assert_eq!(changed.get("z"), Some("last"));
        assert_eq!(original.get("attempt"), Some("1"));
        assert!(changed.remove("id"));
        assert!(!changed.remove("id"));
        assert_eq!(changed.to_map().len(), 2);
        assert_eq!(original.len(), 2);
    }

    #[test]
    fn headers_written_into_blocks_read_as_their_own_do() {
        let mut blocks = Blocks::new();
        let pairs = [("a", "1"), ("message-id", "m-7")];
        let shared = Headers::from_pairs_in(pairs, &mut blocks);
        let payload = blocks.copy(&[b"payload"]);
        assert_eq!(shared, Headers::from_pairs(pairs));
        assert_eq!(shared.get("message-id"), Some("m-7"));
        // In the block, just before the next copy: no allocation of their own.
        let block = shared.block.as_deref().unwrap_or_default();
        assert_eq!(block.as_ptr().wrapping_add(block.len()), payload.as_ptr());
        let unordered = Headers::from_pairs_in([("b", "2"), ("a", "1")], &mut blocks);
        assert_eq!(unordered.to_map().len(), 2);
        assert!(Headers::from_pairs_in([], &mut blocks).is_empty());
    }

    #[test]
    fn no_headers_hold_no_block() {
        let none = Headers::from_pairs([]);
        assert!(none.is_empty() && none.block.is_none());
        assert_eq!(none, Headers::new());
        let mut one = Headers::from_pairs([("a", "1")]);
        assert!(one.remove("a"));
        assert!(one.is_empty() && one.block.is_none());
    }
}
