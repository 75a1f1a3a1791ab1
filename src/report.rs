//! How an error is told to a person: the error and each of its causes, on
//! one line. Errors keep their causes as sources; only here are they joined.

/// `error` and each of its sources, joined by `: `.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_is_told_once() {
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(super::chain(&error), "outer: inner");
    }
}
