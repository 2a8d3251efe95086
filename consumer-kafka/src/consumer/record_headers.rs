//! A fetched record's headers as the transport reads them from librdkafka: as text for the
//! worker, kept as they were when the text would change them, with the transport's own
//! headers picked out on the way.

use consumer_core::transport::{Blocks, Headers};

/// Up to this many headers, [`read_headers`] reads a record's headers from librdkafka once.
const SHORT_HEADERS: usize = 8;

/// A record's headers as librdkafka gives them: names, and values that may be null.
pub(super) type RawHeaders = Vec<(String, Option<Vec<u8>>)>;

/// A record's headers as [`read_headers`] reads them.
pub(super) struct ReadHeaders<'m, const W: usize> {
    /// The headers as text (a null value reads as empty, invalid UTF-8 is replaced, the last
    /// of a repeated name wins).
    pub(super) text: Headers,
    /// The headers as they were, when `text` says less than they did (a null or non-UTF-8
    /// value, a repeated name, names out of order).
    pub(super) raw: Option<RawHeaders>,
    /// Their size in bytes.
    pub(super) bytes: usize,
    /// The names of the headers wanted.
    wanted: [&'m str; W],
    /// Their values, picked out as the headers are read; `None` when `raw` is kept (then
    /// only `text` says what a wanted header reads as).
    picked: Option<[Option<&'m str>; W]>,
}

impl<'m, const W: usize> ReadHeaders<'m, W> {
    /// The values of the headers wanted, in their order, as `text.get` gives them.
    pub(super) fn values<'s>(&'s self) -> [Option<&'s str>; W]
    where
        'm: 's,
    {
        match self.picked {
            Some(picked) => picked,
            None => self.wanted.map(|name| self.text.get(name)),
        }
    }
}

/// Reads a record's headers (see [`ReadHeaders`]), and picks out the values of those named
/// `wanted` on the way, so that the transport's own headers are not looked up again. Most
/// records need only the text, which is then written straight from librdkafka's headers into
/// `blocks`, beside the record's other bytes.
pub(super) fn read_headers<'m, H: rdkafka::message::Headers, const W: usize>(
    hs: Option<&'m H>,
    blocks: &mut Blocks,
    wanted: [&'m str; W],
) -> ReadHeaders<'m, W> {
    let Some(hs) = hs else {
        return ReadHeaders {
            text: Headers::new(),
            raw: None,
            bytes: 0,
            wanted,
            picked: Some([None; W]),
        };
    };
    // Read once: the names and values as text, checked as they are read, held here for
    // the few headers a record usually has.
    let mut text = [("", ""); SHORT_HEADERS];
    let mut picked = [None; W];
    let mut count = 0;
    let mut bytes = 0;
    let mut exact = true;
    let mut last: Option<&str> = None;
    for h in hs.iter() {
        bytes += h.key.len() + h.value.map_or(0, <[u8]>::len);
        let value = h.value.and_then(|v| std::str::from_utf8(v).ok());
        exact &= last.is_none_or(|l| l < h.key) && value.is_some();
        last = Some(h.key);
        if exact {
            for (slot, &w) in picked.iter_mut().zip(&wanted) {
                if w == h.key {
                    *slot = value;
                }
            }
            if let (Some(value), Some(slot)) = (value, text.get_mut(count)) {
                *slot = (h.key, value);
            }
        }
        count += 1;
    }
    if exact {
        let text = if count <= SHORT_HEADERS {
            Headers::from_pairs_in(text[..count].iter().copied(), blocks)
        } else {
            let all = (0..hs.count()).filter_map(|i| {
                let h = hs.get(i);
                Some((h.key, std::str::from_utf8(h.value?).ok()?))
            });
            Headers::from_pairs_in(all, blocks)
        };
        return ReadHeaders {
            text,
            raw: None,
            bytes,
            wanted,
            picked: Some(picked),
        };
    }
    let lossy: Vec<(&str, String)> = hs
        .iter()
        .map(|h| {
            let value = String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned();
            (h.key, value)
        })
        .collect();
    let text = lossy.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let raw = hs
        .iter()
        .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
        .collect();
    ReadHeaders {
        text,
        raw: Some(raw),
        bytes,
        wanted,
        picked: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};
    use std::collections::BTreeMap;

    /// Headers as a test writes them: name, value (`None` for null).
    type Pairs<'a> = &'a [(&'a str, Option<&'a [u8]>)];

    fn headers(pairs: Pairs<'_>) -> OwnedHeaders {
        pairs.iter().fold(OwnedHeaders::new(), |hs, &(key, value)| {
            hs.insert(Header { key, value })
        })
    }

    fn text(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn headers_the_text_map_holds_exactly_are_kept_once() {
        let hs = headers(&[("a", Some(b"1")), ("message-id", Some(b"m-7"))]);
        let read = read_headers(Some(&hs), &mut Blocks::new(), []);
        assert_eq!(
            read.text.to_map(),
            text(&[("a", "1"), ("message-id", "m-7")])
        );
        assert_eq!(read.raw, None);
        assert_eq!(read.bytes, 1 + 1 + 10 + 3);
        let read = read_headers::<OwnedHeaders, 1>(None, &mut Blocks::new(), ["a"]);
        assert!(read.text.is_empty() && read.raw.is_none() && read.bytes == 0);
        assert_eq!(read.values(), [None]);
    }

    #[test]
    fn many_headers_are_read_as_few_are() {
        for n in [
            SHORT_HEADERS - 1,
            SHORT_HEADERS,
            SHORT_HEADERS + 1,
            3 * SHORT_HEADERS,
        ] {
            let names: Vec<String> = (0..n).map(|i| format!("h{i:02}")).collect();
            let pairs: Vec<(&str, Option<&[u8]>)> = names
                .iter()
                .map(|k| (k.as_str(), Some(k.as_bytes())))
                .collect();
            let hs = headers(&pairs);
            let read = read_headers(Some(&hs), &mut Blocks::new(), []);
            let expected: Vec<(&str, &str)> = names.iter().map(|k| (&**k, &**k)).collect();
            assert_eq!(read.text.to_map(), text(&expected), "{n} headers");
            assert_eq!(read.raw, None, "{n} headers");
            assert_eq!(read.bytes, 2 * names.iter().map(String::len).sum::<usize>());
            // One out of order among many: kept as it was.
            let mut swapped = pairs.clone();
            swapped.swap(0, n - 1);
            let hs = headers(&swapped);
            let read = read_headers(Some(&hs), &mut Blocks::new(), []);
            assert_eq!(
                read.raw.map(|r| r.len()),
                Some(n),
                "{n} headers, out of order"
            );
        }
    }

    #[test]
    fn headers_the_text_map_would_change_are_kept_as_they_were() {
        let cases: [Pairs<'_>; 4] = [
            &[("a", None)],
            &[("a", Some(b"\xff\xfe"))],
            &[("a", Some(b"1")), ("a", Some(b"2"))],
            &[("b", Some(b"1")), ("a", Some(b"2"))],
        ];
        for pairs in cases {
            let hs = headers(pairs);
            let read = read_headers(Some(&hs), &mut Blocks::new(), []);
            let (map, raw) = (read.text, read.raw);
            let expected: RawHeaders = pairs
                .iter()
                .map(|&(k, v)| (k.to_owned(), v.map(<[u8]>::to_vec)))
                .collect();
            assert_eq!(raw.as_ref(), Some(&expected), "{pairs:?}");
            // The text map reads as deliveries always did: null is empty, the last name wins.
            let last = |name: &str| pairs.iter().rev().find(|(k, _)| *k == name);
            for (k, v) in &map {
                let (_, value) = last(k).expect("a header of the record");
                assert_eq!(v, String::from_utf8_lossy(value.unwrap_or_default()));
            }
        }
    }

    #[test]
    fn wanted_headers_read_as_the_text_map_gives_them() {
        let cases: [Pairs<'_>; 8] = [
            &[],
            &[("a", Some(b"1"))],
            &[("a", Some(b"1")), ("b", Some(b"")), ("c", Some(b"3"))],
            &[("a", None), ("c", Some(b"3"))],
            &[("a", Some(b"\xff")), ("b", Some(b"2"))],
            &[("a", Some(b"1")), ("a", Some(b"2"))],
            &[("c", Some(b"3")), ("a", Some(b"1"))],
            &[("a", Some(b"1")), ("c", Some(b"3")), ("c", Some(b"4"))],
        ];
        // A name wanted twice reads the same in both places.
        let wanted = ["c", "a", "missing", "a"];
        for pairs in cases {
            let hs = headers(pairs);
            let read = read_headers(Some(&hs), &mut Blocks::new(), wanted);
            let expected = wanted.map(|name| read.text.get(name));
            assert_eq!(read.values(), expected, "{pairs:?}");
        }
        // Many headers, past the few read in one pass: still picked out.
        let names: Vec<String> = (0..3 * SHORT_HEADERS).map(|i| format!("h{i:02}")).collect();
        let pairs: Vec<(&str, Option<&[u8]>)> = names
            .iter()
            .map(|k| (k.as_str(), Some(k.as_bytes())))
            .collect();
        let hs = headers(&pairs);
        let wanted = ["h00", "h23"];
        let read = read_headers(Some(&hs), &mut Blocks::new(), wanted);
        assert_eq!(read.values(), [Some("h00"), Some("h23")]);
    }
}
