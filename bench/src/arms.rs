//! `--arms`: which arms a run keeps.
//!
//! The names are separated by commas, but some arm names hold a comma themselves, always
//! followed by a space (`db floor, 1/tx`, `memory: fw batched, 1 stmt/msg`): a comma
//! followed by a space is part of a name, so `--arms 'db floor, 1/tx$,kafka: fw batched$'`
//! keeps those two arms.

/// The arms a run keeps, by `--arms`' names (at least one).
#[derive(Debug, Clone)]
pub(crate) struct ArmFilter(Vec<String>);

impl ArmFilter {
    /// Parses `--arms`' value: split at every comma, a piece that starts with a space is
    /// the rest of the name before it.
    pub(crate) fn parse(value: &str) -> Result<Self, String> {
        let mut names: Vec<String> = Vec::new();
        for piece in value.split(',') {
            match names.last_mut() {
                Some(name) if piece.starts_with(' ') => {
                    name.push(',');
                    name.push_str(piece);
                }
                _ => names.push(piece.to_owned()),
            }
        }
        names.retain(|n| !n.is_empty());
        if names.is_empty() {
            return Err("no arm named".into());
        }
        Ok(ArmFilter(names))
    }

    /// Whether the run keeps the arm named `arm`: one of the names is in it, or, for a name
    /// ending in `$`, `arm` ends in the rest.
    pub(crate) fn keeps(&self, arm: &str) -> bool {
        self.0.iter().any(|want| match want.strip_suffix('$') {
            Some(end) => arm.ends_with(end),
            None => arm.contains(want.as_str()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::ArmFilter;

    const ARMS: [&str; 5] = [
        "db floor, 1/tx",
        "db floor, N/tx",
        "db floor, N/tx, 1 stmt/msg",
        "memory: fw 1/tx",
        "kafka: fw batched",
    ];

    fn kept(value: &str) -> Vec<&'static str> {
        let filter = ArmFilter::parse(value).unwrap();
        ARMS.into_iter().filter(|a| filter.keeps(a)).collect()
    }

    #[test]
    fn a_comma_followed_by_a_space_is_part_of_a_name() {
        assert_eq!(
            kept("db floor, 1/tx$,kafka: fw batched$"),
            ["db floor, 1/tx", "kafka: fw batched"]
        );
        assert_eq!(
            kept("floor, N/tx"),
            ["db floor, N/tx", "db floor, N/tx, 1 stmt/msg"]
        );
    }

    #[test]
    fn names_without_an_end_mark_are_parts_of_arms_names() {
        assert_eq!(kept("fw,"), ["memory: fw 1/tx", "kafka: fw batched"]);
        assert_eq!(kept("1/tx$"), ["db floor, 1/tx", "memory: fw 1/tx"]);
        assert!(ArmFilter::parse(",").is_err());
    }
}
