//! Which group, and which consumer of it, a call is for: one value instead
//! of two or three strings side by side, which a caller could swap
//! unnoticed.

/// A consumer group of one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupRef<'a> {
    pub stream: &'a str,
    pub group: &'a str,
}

impl<'a> GroupRef<'a> {
    pub fn new(stream: &'a str, group: &'a str) -> Self {
        Self { stream, group }
    }

    /// One consumer of this group.
    pub fn consumer(self, consumer: &'a str) -> ConsumerRef<'a> {
        ConsumerRef { stream: self.stream, group: self.group, consumer }
    }
}

/// One consumer of a stream's group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConsumerRef<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub consumer: &'a str,
}

impl<'a> ConsumerRef<'a> {
    pub fn new(stream: &'a str, group: &'a str, consumer: &'a str) -> Self {
        Self { stream, group, consumer }
    }

    /// The group this consumer reads in.
    pub fn group(self) -> GroupRef<'a> {
        GroupRef { stream: self.stream, group: self.group }
    }
}
