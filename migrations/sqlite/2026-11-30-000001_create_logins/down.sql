DROP TABLE logins;
