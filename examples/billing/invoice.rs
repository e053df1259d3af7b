//! A chunk of the day's invoices: generated from the day and chunk number, so every worker
//! computes the same invoices; only the token that writes them differs.

pub struct Invoice {
    pub line: i32,
    pub customer: String,
    pub amount_cents: i64,
}

pub struct Chunk {
    pub day: String,
    pub number: u32,
    pub invoices: Vec<Invoice>,
    /// The token of the worker that writes it (stored with it, so the data says who wrote it).
    pub token: String,
}

impl Chunk {
    pub fn new(day: &str, number: u32, count: u32, token: &str) -> Self {
        let invoices = (0..count)
            .map(|i| {
                let customer = number * count + i;
                Invoice {
                    line: i as i32,
                    customer: format!("cust-{customer:05}"),
                    // Any deterministic spread of amounts will do.
                    amount_cents: 1_000 + i64::from((customer * 7_919) % 90_000),
                }
            })
            .collect();
        Self {
            day: day.to_owned(),
            number,
            invoices,
            token: token.to_owned(),
        }
    }

    /// The chunk as one JSON document (the S3 object's body).
    pub fn to_json(&self) -> String {
        let invoices: Vec<_> = self
            .invoices
            .iter()
            .map(|i| {
                serde_json::json!({
                    "line": i.line, "customer": i.customer, "amount_cents": i.amount_cents,
                })
            })
            .collect();
        serde_json::json!({
            "day": self.day, "chunk": self.number, "token": self.token, "invoices": invoices,
        })
        .to_string()
    }
}
