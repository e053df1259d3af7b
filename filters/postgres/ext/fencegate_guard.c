/*
 * fencegate_guard: fencegate.guard(text) in C, installed with the C enforce() by
 * `fencegate postgres install --enforce c` (enforce_c.sql). fence.sql's plpgsql guard costs about
 * 300k instructions per call, most of it plpgsql setting up each of its expressions again in
 * every transaction (a guard runs once per transaction, so every call is a first call); the
 * transaction it guards costs about 380k (docs/BENCHMARKS.md).
 *
 * The contract is the plpgsql version's, answer for answer (tests/postgres_store_fence.rs runs
 * a corpus of tokens through both and compares SQLSTATE, message and hint):
 *   malformed token                              -> FG003
 *   keys installed: no key id, unknown or retired key, signature that does not verify -> FG004
 *   then the fence and the pass: fencegate.take_fence(resource, revision)
 * The common case of take_fence (the fence stands at the token's revision and no raise is in
 * progress) is done here: the fence lock taken in share mode without waiting (fence_lock.c, the
 * C install's lighter stand-in for take_fence's FOR SHARE SKIP LOCKED) and the pass set as
 * fencegate.set_pass sets it. Anything else (first token of a resource, a raise, a stale token,
 * a writer in progress) calls fencegate.take_fence itself through SPI, so the rare paths and
 * their messages stay in one place, fence.sql.
 *
 * Runs SECURITY DEFINER as the schema's owner; the token is the only input and is read within
 * its length; the signature is compared in constant time.
 */
#include "postgres.h"

#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "fence_store.h"

PG_FUNCTION_INFO_V1(fencegate_guard);

/* A token's fields; pointers into the token's text, not terminated. */
typedef struct Token
{
	const char *revision;
	int			revision_len;
	int64		revision_value;
	const char *resource;
	int			resource_len;
	const char *kid;			/* NULL: signed without a key id (`~<signature>`) */
	int			kid_len;
	int64		kid_value;
	const char *signature;		/* SIGNATURE_LEN bytes */
} Token;

#define SIGNATURE_LEN 43		/* base64url of 32 bytes, no padding */
#define MAX_RESOURCE_LEN 256

#define MALFORMED_MESSAGE \
	"fencegate: malformed token; expected fg1~<revision>~<resource>[~<kid>.<signature>]"

static bool
all_digits(const char *s, int len)
{
	int			i;

	for (i = 0; i < len; i++)
		if (s[i] < '0' || s[i] > '9')
			return false;
	return true;
}

/*
 * Parses `fg1~<revision>~<resource>[~[<kid>.]<signature>]` as fence.sql's guard validates it:
 * revision 1 to 19 digits without a leading zero and at most 2^63-1; resource 1 to 256
 * characters from '!' to '}'; key id 1 to 10 digits; signature 43 characters of base64url.
 */
static bool
parse_token(const char *s, int len, Token *t)
{
	const char *field[5];
	int			field_len[5];
	int			fields = 0;
	int			start = 0;
	int			i;
	const char *dot;

	memset(t, 0, sizeof(*t));
	for (i = 0; i <= len; i++)
	{
		if (i == len || s[i] == '~')
		{
			if (fields == 4)
				return false;
			field[fields] = s + start;
			field_len[fields] = i - start;
			fields++;
			start = i + 1;
		}
	}
	if (fields != 3 && fields != 4)
		return false;
	if (field_len[0] != 3 || memcmp(field[0], "fg1", 3) != 0)
		return false;

	t->revision = field[1];
	t->revision_len = field_len[1];
	if (t->revision_len < 1 || t->revision_len > 19 || !all_digits(t->revision, t->revision_len)
		|| t->revision[0] == '0'
		|| (t->revision_len == 19 && memcmp(t->revision, "9223372036854775807", 19) > 0))
		return false;
	t->revision_value = 0;
	for (i = 0; i < t->revision_len; i++)
		t->revision_value = t->revision_value * 10 + (t->revision[i] - '0');

	t->resource = field[2];
	t->resource_len = field_len[2];
	if (t->resource_len < 1 || t->resource_len > MAX_RESOURCE_LEN)
		return false;
	for (i = 0; i < t->resource_len; i++)
		if (t->resource[i] < '!' || t->resource[i] > '}')
			return false;

	if (fields == 3)
		return true;
	dot = memchr(field[3], '.', field_len[3]);
	if (dot == NULL)
	{
		t->signature = field[3];
		if (field_len[3] != SIGNATURE_LEN)
			return false;
	}
	else
	{
		t->kid = field[3];
		t->kid_len = dot - field[3];
		t->signature = dot + 1;
		if (field_len[3] - t->kid_len - 1 != SIGNATURE_LEN)
			return false;
		if (t->kid_len < 1 || t->kid_len > 10 || !all_digits(t->kid, t->kid_len))
			return false;
		t->kid_value = 0;
		for (i = 0; i < t->kid_len; i++)
			t->kid_value = t->kid_value * 10 + (t->kid[i] - '0');
	}
	for (i = 0; i < SIGNATURE_LEN; i++)
	{
		char		c = t->signature[i];

		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')
			  || c == '_' || c == '-'))
			return false;
	}
	return true;
}

/*
 * With token keys installed (any row in fencegate.token_keys), the token must be signed with a
 * current key: FG004 otherwise, with fence.sql's messages.
 */
static void
check_signature(const Token *t, Snapshot snap)
{
	static PadCache token_pads;
	static const char b64[] =
		"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
	Relation	rel;
	TupleTableSlot *slot;
	TableScanDesc scan;
	AttrNumber	kid_att;
	AttrNumber	retired_att;
	AttrNumber	ipad_att;
	AttrNumber	opad_att;
	bool		any = false;
	bool		found = false;
	bool		retired = false;
	bytea	   *ipad = NULL;
	bytea	   *opad = NULL;
	char	   *resource = pnstrdup(t->resource, t->resource_len);
	char	   *message;
	uint8		mac[PG_SHA256_DIGEST_LENGTH];
	char		encoded[SIGNATURE_LEN];
	volatile uint8 diff = 0;
	int			i;
	int			o;

	rel = table_open(fencegate_relid("token_keys"), AccessShareLock);
	kid_att = fencegate_column(rel, "kid");
	retired_att = fencegate_column(rel, "retired");
	ipad_att = fencegate_column(rel, "ipad");
	opad_att = fencegate_column(rel, "opad");
	slot = table_slot_create(rel, NULL);
	scan = table_beginscan(rel, snap, 0, NULL);
	while (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		Datum		value;

		any = true;
		if (t->kid == NULL)
			break;
		value = slot_getattr(slot, kid_att, &isnull);
		if (isnull || DatumGetInt64(value) != t->kid_value)
			continue;
		found = true;
		value = slot_getattr(slot, retired_att, &isnull);
		retired = !isnull && DatumGetBool(value);
		value = slot_getattr(slot, ipad_att, &isnull);
		if (!isnull)
			ipad = DatumGetByteaPCopy(value);
		value = slot_getattr(slot, opad_att, &isnull);
		if (!isnull)
			opad = DatumGetByteaPCopy(value);
		break;
	}
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);

	/* Without any key installed, the gateway checks signatures with its own key. */
	if (!any)
		return;
	if (t->kid == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FG_FORGED),
				 errmsg("fencegate: token for resource %s refused: this database requires tokens signed as ~<kid>.<signature>",
						resource)));
	if (!found || retired)
		ereport(ERROR,
				(errcode(ERRCODE_FG_FORGED),
				 errmsg("fencegate: token for resource %s is signed with key %s, which is %s here",
						resource, pnstrdup(t->kid, t->kid_len), found ? "retired" : "unknown"),
				 errhint("Acquire a new token; if the key is new, install the cluster's keys in this database.")));
	if (ipad == NULL || opad == NULL)
		elog(ERROR, "fencegate: fencegate.token_keys has a NULL pad");

	/* The signed text is `fg1~<revision>~<resource>`, the token's first two fields as given. */
	message = psprintf("fg1~%.*s~", t->revision_len, t->revision);
	fencegate_hmac(&token_pads, ipad, opad, (const uint8 *) message, strlen(message),
				   (const uint8 *) t->resource, t->resource_len, mac);
	/* base64url without padding: 32 bytes are 10 groups of 3 and 2 left over. */
	for (i = 0, o = 0; i + 2 < PG_SHA256_DIGEST_LENGTH; i += 3)
	{
		uint32		g = ((uint32) mac[i] << 16) | ((uint32) mac[i + 1] << 8) | mac[i + 2];

		encoded[o++] = b64[(g >> 18) & 0x3f];
		encoded[o++] = b64[(g >> 12) & 0x3f];
		encoded[o++] = b64[(g >> 6) & 0x3f];
		encoded[o++] = b64[g & 0x3f];
	}
	{
		uint32		g = ((uint32) mac[30] << 16) | ((uint32) mac[31] << 8);

		encoded[o++] = b64[(g >> 18) & 0x3f];
		encoded[o++] = b64[(g >> 12) & 0x3f];
		encoded[o++] = b64[(g >> 6) & 0x3f];
	}
	Assert(o == SIGNATURE_LEN);
	for (i = 0; i < SIGNATURE_LEN; i++)
		diff |= (uint8) encoded[i] ^ (uint8) t->signature[i];
	if (diff != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FG_FORGED),
				 errmsg("fencegate: forged token for resource %s: the signature does not verify",
						resource)));
}

/* fence.sql's take_fence, through SPI: the fence's rare paths and their messages. */
static void
take_fence_in_sql(const char *resource, int64 revision)
{
	Oid			types[2] = {TEXTOID, INT8OID};
	Datum		values[2];
	int			rc;

	values[0] = CStringGetTextDatum(resource);
	values[1] = Int64GetDatum(revision);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "fencegate.guard: SPI_connect failed");
	rc = SPI_execute_with_args("SELECT fencegate.take_fence($1, $2)", 2, types, values, NULL,
							   false, 0);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "fencegate.guard: fencegate.take_fence failed: %s", SPI_result_code_string(rc));
	SPI_finish();
}

Datum
fencegate_guard(PG_FUNCTION_ARGS)
{
	static const char hex[] = "0123456789abcdef";
	text	   *token;
	Token		t;
	char	   *resource;
	char	   *held;
	size_t		held_len;
	char	   *pass;
	char	   *fence;
	uint8		mac[PG_SHA256_DIGEST_LENGTH];
	FullTransactionId fxid;
	Snapshot	snap;
	bool		locked;
	int			i;

	if (PG_ARGISNULL(0))
		ereport(ERROR, (errcode(ERRCODE_FG_MALFORMED), errmsg(MALFORMED_MESSAGE)));
	token = PG_GETARG_TEXT_PP(0);
	if (!parse_token(VARDATA_ANY(token), VARSIZE_ANY_EXHDR(token), &t))
		ereport(ERROR, (errcode(ERRCODE_FG_MALFORMED), errmsg(MALFORMED_MESSAGE)));
	resource = pnstrdup(t.resource, t.resource_len);

	/* The snapshot an SPI query of a VOLATILE function takes (new per call in READ COMMITTED). */
	PushActiveSnapshot(GetTransactionSnapshot());
	snap = GetActiveSnapshot();
	check_signature(&t, snap);
	/* As take_fence's SELECT ... FOR SHARE refuses to run in a read-only transaction. */
	PreventCommandIfReadOnly("SELECT FOR SHARE");

	locked = fencegate_share_fence(resource, t.revision_value, LockWaitSkip, &fence);
	if (!locked)
	{
		PopActiveSnapshot();
		take_fence_in_sql(resource, t.revision_value);
		PG_RETURN_VOID();
	}

	/* The pass, as fencegate.set_pass writes it: `revision:resource:mac`. */
	fxid = GetTopFullTransactionId();
	held = psprintf(INT64_FORMAT ":%s", t.revision_value, resource);
	held_len = strlen(held);
	fencegate_pass_mac(held, held_len, fxid, snap, mac);
	PopActiveSnapshot();
	pass = palloc(held_len + PASS_TAIL_LEN + 1);
	memcpy(pass, held, held_len);
	pass[held_len] = ':';
	for (i = 0; i < PG_SHA256_DIGEST_LENGTH; i++)
	{
		pass[held_len + 1 + 2 * i] = hex[mac[i] >> 4];
		pass[held_len + 2 + 2 * i] = hex[mac[i] & 0x0f];
	}
	pass[held_len + PASS_TAIL_LEN] = '\0';
	/* As set_config('fencegate.pass', pass, true). */
	(void) set_config_option("fencegate.pass", pass, superuser() ? PGC_SUSET : PGC_USERSET,
							 PGC_S_SESSION, GUC_ACTION_LOCAL, true, 0, false);
	/* enforce() need not verify the MAC just computed (~10k instructions per transaction). */
	fencegate_remember_pass(pass, fxid);
	PG_RETURN_VOID();
}
