//! Whether a token may write the protected keys of one command: each protected key belongs to
//! the resource its protect rule names (fixed or from the key's `*` captures), and a token for
//! another resource is out of scope. Pure, so golden-tested.

use bytes::Bytes;
use fencegate_core::Token;

use crate::config::{RedisConfig, Scope};

/// `Err(detail)` when a protected key in `keys` belongs to a resource other than the token's.
pub fn check(config: &RedisConfig, token: &Token, keys: &[Bytes]) -> Result<(), String> {
    for key in keys {
        if let Scope::Resource(resource) = config.scope_for(key) {
            if resource != token.resource().as_str() {
                return Err(format!(
                    "out of scope: key {} belongs to resource {resource}, the token is for {}",
                    crate::text::lossy(key, 64),
                    token.resource()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;

    fn token(resource: &str) -> Token {
        Token::new(Resource::new(resource).unwrap(), Revision::new(3).unwrap())
    }

    #[test]
    fn golden() {
        let c: RedisConfig = toml::from_str(
            "[[protect]]\npattern = \"cache:*\"\nmode = \"off\"\n\
             [[protect]]\npattern = \"billing:*:*\"\nresource = \"billing:{1}\"\n",
        )
        .unwrap();
        let keys = |k: &[&str]| -> Vec<Bytes> {
            k.iter()
                .map(|k| Bytes::copy_from_slice(k.as_bytes()))
                .collect()
        };
        let day = token("billing:2026-09-28");
        assert_eq!(
            check(&c, &day, &keys(&["billing:2026-09-28:1", "cache:x"])),
            Ok(())
        );
        assert_eq!(
            check(&c, &day, &keys(&["billing:2026-09-28:1", "billing:2026-09-29:1"])),
            Err("out of scope: key billing:2026-09-29:1 belongs to resource billing:2026-09-29, the token is for billing:2026-09-28".into())
        );
        assert!(check(&c, &token("jobs"), &keys(&["billing:2026-09-28:1"])).is_err());
        assert_eq!(
            check(
                &RedisConfig {
                    protect: Some(vec![crate::config::ProtectRule::every_key()]),
                    ..RedisConfig::default()
                },
                &token("any"),
                &keys(&["k"])
            ),
            Ok(())
        );
    }
}
