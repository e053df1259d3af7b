//! Invoice rows in PostgreSQL, through the gateway. The token travels as a session setting in
//! the startup packet (`options=-c fencegate.token=...`), so the SQL is what the job would send
//! without fencegate.

use fencegate_core::Token;
use tokio_postgres::{Client, NoTls};

use crate::invoice::Chunk;
use crate::outcome::Outcome;

pub struct PostgresStore {
    client: Client,
    day: String,
}

impl PostgresStore {
    pub async fn connect(dsn: &str, token: &str, day: &str) -> anyhow::Result<Self> {
        let mut config: tokio_postgres::Config = dsn
            .parse()
            .map_err(|e| anyhow::anyhow!("BILLING_PG is not a libpq DSN: {e}"))?;
        config.options(format!("-c fencegate.token={token}"));
        let (client, connection) = config.connect(NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("billing: PostgreSQL connection closed: {e}");
            }
        });
        Ok(Self {
            client,
            day: day.to_owned(),
        })
    }

    /// Raises the resource's fence to the token (`fencegate.guard`, the documented way).
    pub async fn raise_fence(&mut self, token: &Token) -> anyhow::Result<Outcome> {
        let revision = i64::try_from(token.revision().get())?;
        let answer = self
            .client
            .execute(
                "SELECT fencegate.guard($1, $2)",
                &[&token.resource().as_str(), &revision],
            )
            .await;
        outcome(answer.map(drop))
    }

    pub async fn has(&self, chunk: &Chunk) -> anyhow::Result<bool> {
        let row = self
            .client
            .query_one(
                "SELECT count(*) FROM invoices WHERE day = $1 AND chunk = $2",
                &[&self.day, &(chunk.number as i32)],
            )
            .await?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    /// The chunk's rows in one transaction.
    pub async fn write(&mut self, chunk: &Chunk) -> anyhow::Result<Outcome> {
        let lines: Vec<i32> = chunk.invoices.iter().map(|i| i.line).collect();
        let customers: Vec<&str> = chunk.invoices.iter().map(|i| i.customer.as_str()).collect();
        let amounts: Vec<i64> = chunk.invoices.iter().map(|i| i.amount_cents).collect();
        let tx = self.client.transaction().await?;
        let inserted = tx
            .execute(
                "INSERT INTO invoices (day, chunk, line, customer, amount_cents, token) \
                 SELECT $1, $2, l, c, a, $3 \
                 FROM unnest($4::int[], $5::text[], $6::bigint[]) AS t(l, c, a)",
                &[
                    &self.day,
                    &(chunk.number as i32),
                    &chunk.token,
                    &lines,
                    &customers,
                    &amounts,
                ],
            )
            .await;
        match inserted {
            // Dropping the transaction rolls it back.
            Err(e) => outcome(Err(e)),
            Ok(_) => outcome(tx.commit().await),
        }
    }
}

/// A refusal (SQLSTATE `FG...`) is an outcome; any other failure is an error.
fn outcome(answer: Result<(), tokio_postgres::Error>) -> anyhow::Result<Outcome> {
    match answer {
        Ok(()) => Ok(Outcome::Written),
        Err(e) => match e.as_db_error() {
            Some(db) if db.code().code().starts_with("FG") => Ok(Outcome::Refused(format!(
                "{}: {}",
                db.code().code(),
                db.message()
            ))),
            _ => Err(e.into()),
        },
    }
}
