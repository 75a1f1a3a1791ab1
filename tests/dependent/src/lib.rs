//! What a planner's own code does with serde_json, beside the client: an
//! untagged enum holding a float, and a struct with a flattened float.
//! serde_json's `arbitrary_precision`, if a dependency turned it on, makes
//! both fail (serde-rs/json 559, 721, 1108).

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum Reading {
        Level(f64),
        Named { name: String },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Machine {
        id: String,
        #[serde(flatten)]
        settings: Settings,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Settings {
        ratio: f64,
    }

    #[test]
    fn an_untagged_enum_holding_a_float_reads_its_number() {
        let readings: Vec<Reading> =
            serde_json::from_str(r#"[1.5, {"name": "idle"}]"#).expect("untagged with a float");
        assert_eq!(
            readings,
            [
                Reading::Level(1.5),
                Reading::Named {
                    name: "idle".into()
                }
            ]
        );
    }

    #[test]
    fn a_flattened_float_reads_its_number() {
        let machine: Machine =
            serde_json::from_str(r#"{"id": "m-1", "ratio": 0.25}"#).expect("a flattened float");
        assert_eq!(machine.settings.ratio, 0.25);
    }

    #[test]
    fn the_client_is_linked_and_reads_a_plan_exactly() {
        // The client's own exactness does not need the feature: a number
        // whose double is not the value written is still refused.
        assert!(plan_intake_client::wire::ijson::parse(b"[0.5]").is_ok());
        assert!(plan_intake_client::wire::ijson::parse(b"[9007199254740993]").is_err());
    }
}
