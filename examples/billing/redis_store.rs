//! One Redis hash per chunk, through the gateway. The connection sends `FENCE <token>` once;
//! after that the job's commands are plain Redis.

use redis::aio::MultiplexedConnection;

use crate::invoice::Chunk;
use crate::outcome::Outcome;

pub struct RedisStore {
    con: MultiplexedConnection,
    day: String,
    token: String,
}

impl RedisStore {
    pub async fn connect(url: &str, token: &str, day: &str) -> anyhow::Result<Self> {
        let mut con = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        redis::cmd("FENCE")
            .arg(token)
            .query_async::<()>(&mut con)
            .await?;
        Ok(Self {
            con,
            day: day.to_owned(),
            token: token.to_owned(),
        })
    }

    fn key(&self, chunk: u32) -> String {
        format!("billing:{}:chunk:{chunk:02}", self.day)
    }

    /// Any fenced write raises the resource's fence; this one also says who holds the run.
    pub async fn raise_fence(&mut self) -> anyhow::Result<Outcome> {
        let key = format!("billing:{}:holder", self.day);
        let answer = redis::cmd("SET")
            .arg(&key)
            .arg(&self.token)
            .query_async::<()>(&mut self.con)
            .await;
        outcome(answer)
    }

    pub async fn has(&mut self, chunk: &Chunk) -> anyhow::Result<bool> {
        Ok(redis::cmd("EXISTS")
            .arg(self.key(chunk.number))
            .query_async::<bool>(&mut self.con)
            .await?)
    }

    /// The chunk as one `HSET`: the writer's token and one field per invoice.
    pub async fn write(&mut self, chunk: &Chunk) -> anyhow::Result<Outcome> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.key(chunk.number))
            .arg("token")
            .arg(&chunk.token);
        for i in &chunk.invoices {
            cmd.arg(format!("line:{}", i.line))
                .arg(format!("{} {}", i.customer, i.amount_cents));
        }
        outcome(cmd.query_async::<()>(&mut self.con).await)
    }
}

/// `-FENCED` and the other refusals are outcomes; anything else is an error.
fn outcome(answer: redis::RedisResult<()>) -> anyhow::Result<Outcome> {
    match answer {
        Ok(()) => Ok(Outcome::Written),
        Err(e) if matches!(e.code(), Some("FENCED" | "NOFENCE" | "BADFENCE")) => {
            Ok(Outcome::Refused(e.to_string()))
        }
        Err(e) => Err(e.into()),
    }
}
