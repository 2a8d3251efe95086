//! One fetched record: what librdkafka gave, what the transport read from its headers (read
//! by `record_headers`), and the envelope handed to the worker.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use consumer_core::transport::{
    Delivery, Headers, Location, LogPosition, MessageId, Origin, Source,
};

use super::record_headers::RawHeaders;
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
    /// exactly the same (see [`read_headers`](super::record_headers::read_headers)): retry and dead-letter copies carry these.
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
/// (a payload's [`Blocks`](consumer_core::transport::Blocks) block, or its own block if it is large).
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
            origin: Origin::Log(position),
            source: Source {
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
    use consumer_core::transport::Blocks;

    fn record(message_id: IdSource) -> Record {
        Record {
            tp: (Arc::from("jobs"), 3),
            offset: 41,
            payload: Bytes::from_static(b"{}"),
            null_payload: false,
            headers: Headers::from(&std::collections::BTreeMap::from([(
                "message_id".to_owned(),
                "m-1".to_owned(),
            )])),
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
