//! One fetched record: what librdkafka gave, what the transport read from its headers,
//! and the envelope handed to the worker.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use consumer_core::transport::{Blocks, Delivery, Headers, Location, LogPosition, MessageId};

use crate::headers;
use crate::tracker::{KeyId, Weigh};

/// A partition: topic and number.
pub(super) type Tp = (Arc<str>, i32);

/// One fetched record, shared by its hand-outs and its acknowledger.
///
/// It keeps what librdkafka gave (payload, key, headers as bytes) and what the transport read
/// from its headers; the [`Delivery`] is built from it when it is handed out
/// ([`Record::delivery`]), off the poll thread and outside the state lock.
#[derive(Debug)]
pub(super) struct Record {
    /// Its partition, as the partition table's key: the acknowledgers and the poll thread
    /// look the partition up by it, so they hold no name of their own.
    pub(super) tp: Tp,
    pub(super) offset: i64,
    /// The topic it retries, if it was read from a retry topic: see [`Record::origin`].
    pub(super) retried: Option<Arc<str>>,
    /// The key and the payload share one buffer (one allocation per record).
    pub(super) key: Option<Bytes>,
    pub(super) payload: Bytes,
    pub(super) null_payload: bool,
    /// The headers as text, as deliveries carry them: one block shared by every hand-out.
    pub(super) headers: Headers,
    /// The headers as librdkafka gave them, kept only where the text map does not hold
    /// exactly the same (see [`read_headers`]): retry and dead-letter copies carry these.
    pub(super) raw_headers: Option<RawHeaders>,
    /// Where its message id comes from: read when a delivery or a copy needs it, so the
    /// record does not hold a second copy of a header.
    pub(super) message_id: IdSource,
    /// From the `x-attempt` header (1 without one).
    pub(super) attempt: u32,
    /// A retry copy this group wrote (on a retry topic, with this group's
    /// [`headers::RETRY_GROUP`]): only then are its due time and origin headers its own.
    pub(super) own_copy: bool,
    /// Payload, key and header bytes: what it counts against the partition's byte limit.
    pub(super) bytes: usize,
    /// When the record was published (its timestamp), if it says.
    pub(super) published_at: Option<std::time::SystemTime>,
}

/// Settled records that nothing else holds any more, kept by the poll thread to hold the
/// next fetched ones: a record then costs no allocation (and no free) of its own.
///
/// A spare holds none of its bytes: its payload, key and headers are let go when it is
/// kept, so that spares never hold memory the partitions' byte limit no longer counts
/// (a payload's [`Blocks`] block, or its own block if it is large).
#[derive(Debug, Default)]
pub(super) struct Spares {
    records: Vec<Arc<Record>>,
}

impl Spares {
    /// At most this many are kept.
    const MAX: usize = 512;

    /// Takes `retired` (emptied): keeps those it may reuse, emptied of their bytes, and
    /// frees the others.
    pub(super) fn keep(&mut self, retired: &mut Vec<Arc<Record>>) {
        for mut record in retired.drain(..) {
            if self.records.len() >= Self::MAX {
                continue;
            }
            if let Some(spare) = Arc::get_mut(&mut record) {
                spare.let_go_of_bytes();
                self.records.push(record);
            }
        }
    }

    /// `record`, shared: in a spare one's place if there is one.
    pub(super) fn make(&mut self, record: Record) -> Arc<Record> {
        if let Some(mut spare) = self.records.pop() {
            if let Some(slot) = Arc::get_mut(&mut spare) {
                *slot = record;
                return spare;
            }
        }
        Arc::new(record)
    }
}

/// Where a record's message id comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IdSource {
    /// The message id header (configured by name), not empty.
    Header,
    /// The record's position, `topic/partition@offset` (offset message ids are on and the
    /// record has no id header).
    Position,
    /// It has none.
    None,
}

impl Record {
    /// A record of no message: a kept acknowledger's ([`super::partitions::State::ackers`]).
    pub(super) fn blank() -> Self {
        Record {
            tp: (Arc::from(""), -1),
            offset: -1,
            retried: None,
            key: None,
            payload: Bytes::new(),
            null_payload: true,
            headers: Headers::new(),
            raw_headers: None,
            message_id: IdSource::None,
            attempt: 1,
            own_copy: false,
            bytes: 0,
            published_at: None,
        }
    }

    /// Drops what it holds of the message's bytes (a spare's, see [`Spares`]).
    fn let_go_of_bytes(&mut self) {
        self.key = None;
        self.payload = Bytes::new();
        self.headers = Headers::new();
        self.raw_headers = None;
    }

    /// Its topic.
    pub(super) fn topic(&self) -> &Arc<str> {
        &self.tp.0
    }

    /// Its partition number.
    pub(super) fn partition(&self) -> i32 {
        self.tp.1
    }

    /// The topic its retry and dead-letter topics are named after (a retry topic's origin).
    pub(super) fn origin(&self) -> &str {
        self.retried.as_deref().unwrap_or(&self.tp.0)
    }

    /// Where it is: `topic/partition@offset` (the form [`Location`]'s `Display` owns).
    pub(super) fn place(&self) -> Location {
        Location::Record {
            topic: self.tp.0.clone(),
            partition: self.tp.1,
            offset: self.offset,
        }
    }

    /// [`Record::place`] as text: for logs, copies, and the message id derived from it.
    pub(super) fn location(&self) -> String {
        use std::fmt::Write as _;
        // Sized up front (a partition takes at most 11 characters, an offset 20).
        let mut s = String::with_capacity(self.tp.0.len() + 33);
        let _ = write!(s, "{}", self.place());
        s
    }

    /// Its message id: the header named `header` (sharing the record's block of headers),
    /// or its position (see [`IdSource`]).
    pub(super) fn message_id(&self, header: &str) -> Option<MessageId> {
        match self.message_id {
            IdSource::Header => self
                .headers
                .get_bytes(header)
                .and_then(MessageId::from_shared),
            IdSource::Position => Some(self.location().into()),
            IdSource::None => None,
        }
    }

    /// The envelope handed to the worker; `id_header` names the message id header.
    pub(super) fn delivery(
        &self,
        attempt: u32,
        redelivered: bool,
        position: LogPosition,
        id_header: &str,
    ) -> Delivery {
        let mut headers = self.headers.clone();
        if attempt > 1 {
            let attempt = attempt.to_string();
            // A retry copy usually says so already; a record retried in place does not.
            if headers.get(headers::ATTEMPT) != Some(attempt.as_str()) {
                headers.insert(headers::ATTEMPT, attempt);
            }
        }
        Delivery {
            message_id: self.message_id(id_header),
            payload: self.payload.clone(),
            headers,
            redelivered,
            attempt,
            // A record past the committed offset may have been processed by a member that
            // then died: Kafka cannot say. Its position lets the runtime tell.
            origin: consumer_core::transport::Origin::Log(position),
            source: consumer_core::transport::Source {
                transport: "kafka",
                // Formatted only if shown: no text is built per delivery.
                location: self.place(),
            },
            published_at: self.published_at,
        }
    }

    /// The headers as the record carried them, in its order, as (name, value) pairs.
    pub(super) fn original_headers(&self) -> RawHeaders {
        match &self.raw_headers {
            Some(raw) => raw.clone(),
            None => self
                .headers
                .iter()
                .map(|(k, v)| (k.to_owned(), Some(v.as_bytes().to_vec())))
                .collect(),
        }
    }
}

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

/// A record as the tracker holds it: the record and the attempt its next hand-out carries.
#[derive(Debug)]
pub(super) struct Handout {
    pub(super) record: Arc<Record>,
    pub(super) attempt: u32,
    pub(super) redelivered: bool,
}

impl Weigh for Handout {
    fn weight(&self) -> usize {
        self.record.bytes
    }
}

/// The record's ordering key, hashed with this consumer's random seed (see [`KeyId`]).
pub(super) fn key_id(seed: &foldhash::quality::RandomState, key: Option<&[u8]>) -> KeyId {
    key.map(|k| seed.hash_one(k))
}

pub(super) fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
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

    fn record(message_id: IdSource) -> Record {
        Record {
            tp: (Arc::from("jobs"), 3),
            offset: 41,
            payload: Bytes::from_static(b"{}"),
            null_payload: false,
            headers: Headers::from(&text(&[("message_id", "m-1")])),
            message_id,
            bytes: 2,
            ..Record::blank()
        }
    }

    #[test]
    fn a_kept_spare_holds_none_of_the_bytes_of_its_record() {
        /// Bytes whose owner holds `alive` (below): its count tells how many are left.
        struct Owned(#[allow(dead_code)] Arc<()>, &'static [u8]);
        impl AsRef<[u8]> for Owned {
            fn as_ref(&self) -> &[u8] {
                self.1
            }
        }
        let alive = Arc::new(());
        let owned = || Bytes::from_owner(Owned(alive.clone(), b"{}"));
        let mut retired: Vec<Arc<Record>> = (0..3)
            .map(|_| {
                let mut r = record(IdSource::Header);
                r.payload = owned();
                r.key = Some(owned());
                r.raw_headers = Some(vec![("a".to_owned(), None)]);
                Arc::new(r)
            })
            .collect();
        // One is still held elsewhere: not kept.
        let held = retired[2].clone();
        let mut spares = Spares::default();
        spares.keep(&mut retired);
        assert!(retired.is_empty());
        assert_eq!(spares.records.len(), 2);
        // The held record's payload and key are all the bytes still alive.
        assert_eq!(Arc::strong_count(&alive), 1 + 2);
        drop(held);
        assert_eq!(Arc::strong_count(&alive), 1);
        for spare in &spares.records {
            assert!(spare.payload.is_empty() && spare.key.is_none());
            assert!(spare.headers.is_empty() && spare.raw_headers.is_none());
        }
        // A spare takes the next record's place whole.
        let next = spares.make(record(IdSource::Header));
        assert_eq!(
            (&next.payload[..], next.headers.get("message_id")),
            (&b"{}"[..], Some("m-1"))
        );
        assert_eq!(spares.records.len(), 1);
    }

    #[test]
    fn the_message_id_is_read_where_the_record_says() {
        let position = LogPosition {
            log: Arc::from("g/jobs/3"),
            epoch: 1,
            offset: 41,
        };
        let cases = [
            (IdSource::Header, Some("m-1")),
            (IdSource::Position, Some("jobs/3@41")),
            (IdSource::None, None),
        ];
        for (source, expected) in cases {
            let r = record(source);
            assert_eq!(
                r.message_id("message_id").as_deref(),
                expected,
                "{source:?}"
            );
            let d = r.delivery(1, false, position.clone(), "message_id");
            assert_eq!(d.message_id.as_deref(), expected, "{source:?}");
            assert_eq!(d.source.location.to_string(), "jobs/3@41");
        }
    }

    /// A record's headers sit in the poll thread's shared blocks; the id header handed out
    /// is a slice of that block, not a copy (which the worker thread would free: an
    /// allocation a record across threads).
    #[test]
    fn the_message_id_handed_out_shares_the_records_headers() {
        let mut blocks = Blocks::new();
        let mut r = record(IdSource::Header);
        r.headers = Headers::from_pairs_in([("message_id", "m-1")], &mut blocks);
        let position = LogPosition {
            log: Arc::from("g/jobs/3"),
            epoch: 1,
            offset: 41,
        };
        let d = r.delivery(1, false, position, "message_id");
        let id = d.message_id.expect("an id");
        assert_eq!(id, "m-1");
        assert_eq!(
            id.as_ptr(),
            r.headers.get("message_id").expect("the header").as_ptr()
        );
    }
}
