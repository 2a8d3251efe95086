//! [`MessageId`]: a delivery's message id, shared with the block its transport read it into.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use bytes::Bytes;
use bytestring::ByteString;

/// The producer-assigned id of a message, as text ([`Delivery::message_id`]).
///
/// It reads as a `&str` (it derefs to one), and cloning it is a reference count. A transport
/// that reads a message's headers into a shared block hands the id out as a slice of that
/// block ([`MessageId::from_shared`], [`Headers::get_bytes`]), so that handing out a delivery
/// neither copies the id nor allocates for it; built from a `String` it takes that string's
/// buffer over.
///
/// [`Delivery::message_id`]: crate::transport::Delivery::message_id
/// [`Headers::get_bytes`]: crate::transport::Headers::get_bytes
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId(ByteString);

impl MessageId {
    /// The text of `bytes`, sharing them (no copy), or `None` if they are not UTF-8.
    pub fn from_shared(bytes: Bytes) -> Option<Self> {
        ByteString::try_from(bytes).ok().map(MessageId)
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for MessageId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for MessageId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for MessageId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<String> for MessageId {
    fn from(id: String) -> Self {
        MessageId(ByteString::from(id))
    }
}

impl From<&str> for MessageId {
    fn from(id: &str) -> Self {
        MessageId(ByteString::from(id))
    }
}

impl From<MessageId> for String {
    fn from(id: MessageId) -> Self {
        id.as_str().to_owned()
    }
}

impl PartialEq<str> for MessageId {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for MessageId {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An id read out of a shared block is that block's bytes, not a copy of them.
    #[test]
    fn an_id_from_a_shared_block_shares_its_bytes() {
        let block = Bytes::from_static(b"xxmsg-1yy");
        let id = MessageId::from_shared(block.slice(2..7)).expect("UTF-8");
        assert_eq!(id, "msg-1");
        assert_eq!(id.as_ptr(), block[2..].as_ptr());
        assert_eq!(MessageId::from_shared(Bytes::from_static(b"\xff")), None);
    }

    /// It reads, compares, prints and converts as the text it holds.
    #[test]
    fn an_id_reads_as_its_text() {
        let id = MessageId::from("m-7".to_owned());
        assert_eq!(id.as_str(), "m-7");
        assert_eq!(Some(id.clone()).as_deref(), Some("m-7"));
        assert_eq!(format!("{id} {id:?}"), "m-7 \"m-7\"");
        assert_eq!(String::from(id), "m-7");
    }
}
